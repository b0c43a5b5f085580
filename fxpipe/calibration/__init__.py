"""Everything that measures or tunes the host fxpipe runs on.

Its face is the machine model, plain data a plan records and the cost model reads: the compute rates
(:class:`fxpipe.plan.ComputeRates`, :mod:`fxpipe.calibration.compute`) and the runtime's fixed costs
(:class:`fxpipe.plan.RuntimeOverheads`, :mod:`fxpipe.calibration.runtime_costs`), both measured once per machine
and cached. :class:`~fxpipe.calibration.host.HostTuning` names the process-wide settings a rank may ask for
(:mod:`~fxpipe.calibration.threads`, :mod:`~fxpipe.calibration.host_memory`); nothing here changes the process
unless asked. :mod:`~fxpipe.calibration.probes` holds the small model both calibrations time.

The package sits below ``fxpipe.api`` and above the passes and the runtime, whose pipelines it times; planning
and the schedules never import it (docs/architecture.md).
"""

from __future__ import annotations

from fxpipe.calibration.host import HostTuning

__all__ = ["HostTuning"]
