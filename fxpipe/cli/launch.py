"""torchrun with warm ranks: ``python -m fxpipe.cli.launch [torchrun's options] -m fxpipe.cli.rank RUN_JSON --out DIR``.

torch's own launcher, through its public parts: ``torch.distributed.run`` reads the options (all of torchrun's) and
``elastic_launch`` runs its elastic agent (rendezvous, restarts, the failure summary). The one difference is how a
rank starts: torchrun execs a new Python per rank, which imports torch, Dynamo and fxpipe again (seconds of CPU
each); here every rank is a fork of this process, which imported them once (torchrun's ``--start-method fork``,
which torch offers for a function as the entry point). Nothing runs on torch's thread pools before the fork.

torch's summary of a failed run then names only the first rank it saw fail, where torchrun's named each: a rank
killed outright (SIGKILL, the out-of-memory killer) and a peer that stopped because of it can end within one poll,
and the peer may be the one named. So this process, the ranks' parent, reads every rank's exit itself (``waitid``
without reaping it: torch's agent still does) and prints them after a failure in the summary's own format.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import uuid
from pathlib import Path


def _rank(*argv: str) -> None:
    """One rank, in the forked process: the signals as a new Python has them (the agent's handlers, which turn
    SIGTERM into an exception, are not the rank's), then ``fxpipe.cli.rank``; a failure is the exit code."""
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from fxpipe.cli import rank

    code = rank.main(list(argv))
    if code:
        raise SystemExit(code)


def warm(rank_argv: list[str]) -> None:
    """Import what every rank imports, once, before the ranks fork: torch, its distributed package, Dynamo (which
    an optimizer's first ``add_param_group`` loads), fxpipe's runtime and rank, and transformers when the plan's
    outputs are its types (a Hugging Face model's). Nothing a user's file names: a rank imports that itself."""
    import importlib

    import torch.distributed  # noqa: F401
    import torch.optim  # noqa: F401

    import fxpipe.cli.feed  # noqa: F401
    import fxpipe.cli.rank  # noqa: F401
    import fxpipe.cli.run_config  # noqa: F401
    import fxpipe.runtime  # noqa: F401
    from fxpipe._compat import load_dynamo

    load_dynamo()
    for module in _libraries(rank_argv):
        try:
            importlib.import_module(module)
        except ImportError:
            pass


def _libraries(rank_argv: list[str]) -> list[str]:
    """The installed libraries the ranks of this run will import: transformers (and its output types) when the
    plan's manifest names them. Any file that cannot be read: none (each rank reports its own error)."""
    from fxpipe.cli.rank import rank_args

    try:
        plan = Path(rank_args(Path(rank_argv[0]), "").plan) / "plan.json"
        named = '"transformers.' in plan.read_text()
    except Exception:  # noqa: BLE001  (the ranks read the same files and say what is wrong with them)
        return []
    return ["transformers", "transformers.modeling_outputs"] if named else []


def _children() -> set[int]:
    """This process's children: the main thread's (which forks the ranks), from ``/proc`` (one small file), else
    from ``psutil`` (a scan of every process)."""
    me = os.getpid()
    try:
        return {int(pid) for pid in Path(f"/proc/{me}/task/{me}/children").read_text().split()}
    except OSError:
        import psutil  # type: ignore[import-untyped]  # psutil ships no type information

        try:
            return {child.pid for child in psutil.Process(me).children()}
        except psutil.Error:
            return set()


class Exits:
    """Each rank process's exit as this process (their parent) sees it: a thread per child blocks in ``waitid``
    with ``WNOWAIT``, which reports the exit and leaves the child for torch's agent to reap."""

    def __init__(self, out_dir: Path, every: float = 0.05) -> None:
        self.out_dir = out_dir
        self.codes: dict[int, int] = {}  # pid -> exit code (-N: signal N)
        self._seen: set[int] = set()
        self._done = threading.Event()
        threading.Thread(target=self._follow, args=(every,), name="fxpipe-rank-exits", daemon=True).start()

    def close(self) -> None:
        """Stop looking for new children (those seen are still waited for)."""
        self._done.set()

    def _follow(self, every: float) -> None:
        while not self._done.is_set():
            for pid in _children() - self._seen:
                self._seen.add(pid)
                threading.Thread(target=self._wait, args=(pid,), name=f"fxpipe-exit-{pid}", daemon=True).start()
            self._done.wait(every)

    def _wait(self, pid: int) -> None:
        try:
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:  # reaped first (the agent saw it before this thread woke)
            return
        if info is not None:
            killed = info.si_code in (os.CLD_KILLED, os.CLD_DUMPED)
            self.codes[pid] = -info.si_status if killed else info.si_status

    def summary(self) -> str:
        """The ranks of the last attempt (their ``rank{R}.pid`` files) that exited non-zero, as torch's summary
        lists a failure (``fxpipe.cli.ranks.died_ranks`` reads both)."""
        from fxpipe.cli.ranks import rank_pids

        lines = [f"  rank      : {rank} (local_rank: {rank})\n  exitcode  : {self.codes[pid]} (pid: {pid})\n"
                 for pid, rank in sorted(rank_pids(self.out_dir).items(), key=lambda item: item[1])
                 if self.codes.get(pid)]
        return "fxpipe.cli.launch: the ranks' exits\n" + "".join(lines) if lines else ""


def main(argv: list[str] | None = None) -> None:
    """torchrun's options in, the ranks of ``-m fxpipe.cli.rank`` forked out; torch's exit and summary."""
    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    from fxpipe.cli.ranks import RANK_MODULE

    args = parse_args(sys.argv[1:] if argv is None else argv)
    if not args.module or args.training_script != RANK_MODULE:
        raise SystemExit(f"fxpipe.cli.launch starts -m {RANK_MODULE} only, not {args.training_script}")
    if args.standalone:  # as torchrun does: a c10d rendezvous on a free local port
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500  # torchrun's default for the static rendezvous
    args.start_method = "fork"
    config, _, _ = config_from_args(args)
    rank_argv = list(args.training_script_args)
    warm(rank_argv)
    exits = Exits(Path(rank_argv[rank_argv.index("--out") + 1]) if "--out" in rank_argv[:-1] else Path("."))
    try:
        record(lambda: elastic_launch(config, entrypoint=_rank)(*rank_argv))()
    except BaseException:
        time.sleep(0.1)  # a thread still writing down an exit the agent has already seen
        sys.stderr.write(exits.summary())
        raise


if __name__ == "__main__":
    main()
