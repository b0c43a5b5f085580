"""fxpipe run's agent on one machine: torchrun's elastic agent, with the ranks forked from one warm process.

It takes torchrun's arguments, parsed by ``torch.distributed.run`` itself (rendezvous, nodes, restarts), and
runs the same ``elastic_launch``. Only the entrypoint differs: ``fxpipe.cli.rank`` as a function started by
the ``forkserver`` method, whose server has imported torch, AOTAutograd, torch's launcher and the rank module
once. A rank that torchrun would start as a new Python (importing torch and Dynamo again, seconds of CPU each)
is a fork of it, sharing those pages copy-on-write; so is the agent itself. This process imports no torch: it
starts the server, has it fork the agent (which then asks the same server for its ranks) and exits as the
agent did. The server is forked from nothing that ran torch: no thread pool, no CUDA.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import traceback
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fxpipe.cli.ranks import RANK_MODULE, rank_pids  # no torch: the fork server starts before this process imports it

# What the fork server imports once, for the agent (torch's launcher) and every rank (see fxpipe.cli.rank.entry).
PRELOAD = ["torch", "torch.distributed", "torch._functorch.aot_autograd", "torch.distributed.run",
           "torch.distributed.launcher.api", "fxpipe.cli.rank", "fxpipe.cli.agent"]


def main(argv: list[str] | None = None) -> None:
    import multiprocessing
    from multiprocessing import forkserver

    argv = sys.argv[1:] if argv is None else argv
    at = argv.index(RANK_MODULE) if RANK_MODULE in argv else 0
    if at == 0 or argv[at - 1] not in ("-m", "--module"):
        raise SystemExit(f"fxpipe.cli.agent starts -m {RANK_MODULE} only (got {' '.join(argv)[:200]!r})")
    launcher, stop, started = os.getppid(), [], []
    agent = multiprocessing.get_context("forkserver").Process(target=_agent, args=(argv,), name="fxpipe-agent")

    def on_signal(sig: int, _frame: object) -> None:
        # fxpipe run signals this process's group, which holds the agent (once started): it needs nothing from here.
        # When fxpipe run is gone (PR_SET_PDEATHSIG's SIGTERM) the signal is passed on; before the agent starts,
        # it means: do not start it.
        if not started:
            stop.append(sig)
        elif os.getppid() != launcher and agent.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(agent.pid, sig)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    _short_socket_dir()
    multiprocessing.set_forkserver_preload(PRELOAD)
    forkserver.ensure_running()
    if stop:
        _die_by(stop[0])
    agent.start()
    if stop:  # it came as the agent started: pass it on, the agent may have missed it
        os.kill(agent.pid, stop[0])
    started.append(True)
    agent.join()
    code = 1 if agent.exitcode is None else agent.exitcode
    if code < 0:  # the agent died by a signal: so does this process, as torchrun would have
        _die_by(-code)
    raise SystemExit(code)


def _die_by(sig: int) -> None:
    """End this process by ``sig``'s default action, as a process without a handler for it would."""
    signal.signal(sig, signal.SIG_DFL)
    os.kill(os.getpid(), sig)
    raise SystemExit(128 + sig)  # a signal whose default is to be ignored


def _agent(argv: list[str]) -> None:
    """The agent, forked by the server: torchrun's ``main`` as ``record`` runs it."""
    from torch.distributed.elastic.multiprocessing.errors import record

    from fxpipe import _compat

    _compat.reuse_forkserver()  # the ranks come from the server that forked this process
    try:
        record(_launch)(argv)  # as torchrun's main: a failure's summary on stderr, and the exit code
    except SystemExit:
        raise
    except BaseException:  # as Python's top level prints it, with its exit code
        traceback.print_exc()
        sys.stderr.flush()
        raise SystemExit(1) from None


def _launch(argv: list[str]) -> None:
    from torch.distributed import run as torchrun
    from torch.distributed.launcher.api import elastic_launch

    from fxpipe.cli.rank import entry

    args = torchrun.parse_args(argv)
    if not args.module or args.training_script != RANK_MODULE or args.no_python or args.run_path:
        raise SystemExit(f"fxpipe.cli.agent starts -m {RANK_MODULE} only (got {args.training_script!r})")
    if args.standalone:  # as torchrun's run(): a c10d store on a free local port, a fresh run id
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    elif args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None:
        if torchrun.parse_min_max_nnodes(args.nnodes)[1] == 1:
            args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    config, _python, cmd_args = torchrun.config_from_args(args)
    config.start_method = "forkserver"
    rank_args = cmd_args[cmd_args.index(RANK_MODULE) + 1:]  # after torchrun's "-u -m fxpipe.cli.rank"
    with _exits(Path(rank_args[rank_args.index("--out") + 1])):
        elastic_launch(config=config, entrypoint=entry)(*rank_args)


@contextlib.contextmanager
def _exits(out_dir: Path) -> Iterator[None]:
    """When the launch fails, every rank process that exited non-zero, in the lines of torchrun's failure summary.

    torch.multiprocessing's join (which the agent polls for function entrypoints) raises for the first failed process
    it finds, and the summary names that one alone; torchrun's command entrypoints list every failure. A rank that was
    killed (SIGKILL: the out-of-memory killer) while a peer failed at once, reporting that it lost it, would go unnamed.
    """
    from fxpipe import _compat

    contexts: list[Any] = []
    with _compat.process_contexts(contexts.append):
        try:
            yield
        except BaseException:
            if contexts:
                ranks = rank_pids(out_dir)
                for local, proc in enumerate(contexts[-1].processes):
                    if proc.exitcode and proc.pid in ranks:
                        print(f"  rank      : {ranks[proc.pid]} (local_rank: {local})\n  exitcode  : {proc.exitcode} "
                              f"(pid: {proc.pid})", file=sys.stderr, flush=True)
            raise


def _short_socket_dir() -> None:
    """Make multiprocessing's own temporary directory (where the fork server's Unix socket lives, a path of at most
    107 bytes) in the system's temporary directory when ``TMPDIR`` (fxpipe run's report directory) is too deep for
    it. multiprocessing removes it when this process exits."""
    import tempfile
    from multiprocessing import util

    if len(tempfile.gettempdir()) <= 60:
        return
    short = next((d for d in ("/tmp", "/var/tmp") if os.path.isdir(d) and os.access(d, os.W_OK)), None)
    if short is None:
        return
    saved, tempfile.tempdir = tempfile.tempdir, short
    try:
        util.get_temp_dir()  # created now, under ``short``, and kept for this process
    finally:
        tempfile.tempdir = saved


if __name__ == "__main__":
    main()
