"""fxpipe run's agent on one machine: torchrun's elastic agent, with the ranks forked from one warm process.

It takes torchrun's arguments, parsed by ``torch.distributed.run`` itself (rendezvous, nodes, restarts), and
runs the same ``elastic_launch``. Only the entrypoint differs: ``fxpipe.cli.rank`` as a function started by
the ``forkserver`` method. This process (the launch's root: the session fxpipe run signals) imports torch,
AOTAutograd, torch's launcher and the rank module once, then forks multiprocessing's fork server from itself
(:func:`fork_server`), which forks the agent and every rank. A rank that torchrun would start as a new Python
(importing torch and Dynamo again, seconds of CPU each) shares those pages copy-on-write instead. Nothing here
ran torch before the forks: no thread pool, no CUDA.

A process that launches many runs (a sweep, a test suite) may keep one such root warm (:func:`warm_launches`):
each launch's root is then a fork of it, not a new Python, and the import is paid once.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any

from fxpipe.cli.ranks import LAUNCHER_PID, RANK_MODULE, rank_pids  # no torch: the launcher may not have imported it

# What a launch's root imports once, for the agent (torch's launcher) and every rank (see fxpipe.cli.rank.entry).
PRELOAD = ["torch", "torch.distributed", "torch._functorch.aot_autograd", "torch.distributed.run",
           "torch.distributed.launcher.api", "fxpipe.cli.rank", "fxpipe.cli.agent"]


def main(argv: list[str] | None = None) -> None:
    """``python -m fxpipe.cli.agent TORCHRUN-ARGS``: the launch's root as a new Python."""
    argv = sys.argv[1:] if argv is None else argv
    _check(argv)
    _root(argv, launcher=os.getppid(), imported=False)


def _check(argv: list[str]) -> None:
    at = argv.index(RANK_MODULE) if RANK_MODULE in argv else 0
    if at == 0 or argv[at - 1] not in ("-m", "--module"):
        raise SystemExit(f"fxpipe.cli.agent starts -m {RANK_MODULE} only (got {' '.join(argv)[:200]!r})")


def _root(argv: list[str], *, launcher: int, imported: bool) -> None:
    """Import :data:`PRELOAD` (unless this process is a fork that has), fork the server, have it fork the agent,
    and exit as the agent did. ``launcher``: this process's parent when it started."""
    import multiprocessing

    stop: list[int] = []
    agent: list[Any] = []

    def on_signal(sig: int, _frame: object) -> None:
        # fxpipe run signals this process's group, which holds the agent (once started): it needs nothing from here.
        # When fxpipe run is gone (PR_SET_PDEATHSIG's SIGTERM) the signal is passed on; before the agent starts,
        # it means: do not start it.
        if not agent:
            stop.append(sig)
        elif os.getppid() != launcher and agent[0].pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(agent[0].pid, sig)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    if not imported:
        for name in PRELOAD:  # a signal meanwhile is noted by on_signal: none crosses torch's C++ initialisation
            importlib.import_module(name)
    if stop:
        _die_by(stop[0])
    _short_socket_dir()
    fork_server()
    process = multiprocessing.get_context("forkserver").Process(target=_agent, args=(argv,), name="fxpipe-agent")
    process.start()
    agent.append(process)
    if stop:  # it came as the agent started: pass it on, the agent may have missed it
        os.kill(process.pid, stop[0])
    process.join()
    code = 1 if process.exitcode is None else process.exitcode
    if code < 0:  # the agent died by a signal: so does this process, as torchrun would have
        _die_by(-code)
    raise SystemExit(code)


def fork_server() -> None:
    """Start multiprocessing's fork server as a fork of this process, and make this process's ``forkserver``
    processes (and theirs, see :func:`fxpipe._compat.reuse_forkserver`) come from it. multiprocessing's own
    ``ensure_running`` starts a new Python, which would import everything again. The server runs
    ``multiprocessing.forkserver.main``, the loop of the server it replaces, with nothing to import; where that loop
    takes an authentication key (newer Pythons), it gets one."""
    from multiprocessing import connection, forkserver, resource_tracker

    resource_tracker.ensure_running()  # the server's forks report to this process's tracker, as they would
    server = forkserver._forkserver
    listener = socket.socket(socket.AF_UNIX)
    address = connection.arbitrary_address("AF_UNIX")
    listener.bind(address)
    os.chmod(address, 0o600)
    listener.listen()
    alive_r, alive_w = os.pipe()  # every client holds the write end: the server leaves when the last one is gone
    key_r = _authkey(server)
    kwargs = {} if key_r is None else {"authkey_r": key_r}
    server._forkserver_address, server._forkserver_alive_fd = address, alive_w  # before the fork: its forks need them
    pid = os.fork()
    if pid == 0:  # the server: it never returns into this process's code
        code = 0
        try:
            os.close(alive_w)
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                signal.signal(sig, signal.SIG_DFL)
            forkserver.main(listener.fileno(), alive_r, [], **kwargs)
        except SystemExit:  # its last client is gone
            pass
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            os._exit(code)
    listener.close()
    os.close(alive_r)
    if key_r is not None:
        os.close(key_r)
    server._forkserver_pid = pid


def _authkey(server: Any) -> int | None:
    """Where multiprocessing's fork server loop takes an authentication key (newer Pythons): a fresh one for
    ``server``'s clients, and the read end of a pipe holding it for the server (its ``authkey_r``); else None."""
    from multiprocessing import forkserver

    if "authkey_r" not in inspect.signature(forkserver.main).parameters:
        return None
    key = secrets.token_bytes(getattr(forkserver, "_AUTHKEY_LEN", 32))
    key_r, key_w = os.pipe()
    os.write(key_w, key)  # fits the pipe's buffer: the server reads it as it starts
    os.close(key_w)
    server._forkserver_authkey = key
    return key_r


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
    from multiprocessing import util

    short = _short_dir()
    if short is None:
        return
    saved, tempfile.tempdir = tempfile.tempdir, short
    try:
        util.get_temp_dir()  # created now, under ``short``, and kept for this process
    finally:
        tempfile.tempdir = saved


# -- warm launches ----------------------------------------------------------------------------------------------------

# Environment variables a launch's root reads as its interpreter starts or as it imports PRELOAD: a warm root serves
# only the launches that agree with it on them. The others (and these run-time ones) are set in each fork.
_IMPORT_TIME = ("PYTHON", "TORCH", "PYTORCH", "OMP_", "MKL", "KMP_", "GOMP_", "LD_", "CUDA", "NCCL", "GLOO")
_RUN_TIME = frozenset({"TORCHINDUCTOR_CACHE_DIR", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"})
_KEEP = 2  # warm roots kept at once, for launches whose environments differ (the oldest is let go)
_warm: list[dict[tuple[tuple[str, str], ...], _Warm]] = []  # one per active warm_launches, innermost last
_warm_lock = threading.Lock()


@contextlib.contextmanager
def warm_launches() -> Iterator[None]:
    """Meanwhile, each ``fxpipe run`` launch this process makes forks its root from a warm one, which imported
    torch, AOTAutograd and torch's launcher once, instead of starting a new Python that imports them again (about
    4 CPU-seconds a launch). For a process that launches many runs: a sweep, a test suite. A launch whose
    import-time environment (``TORCH*``, ``OMP_*``, ``PYTHON*``, ...) differs gets a warm root of its own. Nested,
    the innermost keeps roots of its own, and lets them go as it ends."""
    roots: dict[tuple[tuple[str, str], ...], _Warm] = {}
    _warm.append(roots)
    try:
        yield
    finally:
        _warm.remove(roots)
        for root in roots.values():
            root.close()


def warm_start(cmd: list[str], env: Mapping[str, str], stdout: IO[Any], stderr: IO[Any]) -> Any | None:
    """Start ``cmd`` (``python -m fxpipe.cli.agent ARGS``) as a fork of a warm root when :func:`warm_launches` is
    on: a handle with ``pid``, ``poll()``, ``wait()`` and ``returncode``, as ``subprocess.Popen``'s. None when it
    is off or the warm root could not start it (then the caller starts ``cmd`` itself)."""
    if not _warm or cmd[1:3] != ["-m", __name__] or cmd[0] != sys.executable:
        return None
    with _warm_lock:  # launches from several threads: each root is taken by one at a time
        return _warm_start(_warm[-1], cmd, env, stdout, stderr)


def _warm_start(roots: dict[tuple[tuple[str, str], ...], _Warm], cmd: list[str], env: Mapping[str, str],
                stdout: IO[Any], stderr: IO[Any]) -> Any | None:
    key = tuple(sorted((k, v) for k, v in env.items() if k.startswith(_IMPORT_TIME) and k not in _RUN_TIME))
    root = roots.pop(key, None)  # reinserted last: the most recently used stays
    try:
        if root is None:
            root = _Warm({k: v for k, v in env.items() if k not in _RUN_TIME and k not in ("TMPDIR", LAUNCHER_PID)})
        handle = root.start(cmd[3:], env, stdout, stderr)
    except (OSError, EOFError, ValueError):  # the warm root is gone or refused: the caller starts a new Python
        if root is not None:
            root.close()
        return None
    roots[key] = root
    while len(roots) > _KEEP:
        roots.pop(next(iter(roots))).close()
    return handle


class _Warm:
    """A fork server (multiprocessing's, as a new Python that imported :data:`PRELOAD`) whose forks are launch
    roots, each running :func:`_warm_root`. It leaves when :meth:`close` lets go of its "alive" pipe."""

    def __init__(self, env: Mapping[str, str]) -> None:
        from multiprocessing import forkserver

        self.dir = tempfile.mkdtemp(prefix="fxpipe-warm-", dir=_short_dir())
        self.server = forkserver.ForkServer()
        address = os.path.join(self.dir, "socket")
        alive_r, alive_w = os.pipe()
        key_r = _authkey(self.server)
        try:
            with socket.socket(socket.AF_UNIX) as listener:
                listener.bind(address)
                listener.listen()
                fds = [listener.fileno(), alive_r, *([] if key_r is None else [key_r])]
                auth = "" if key_r is None else f", authkey_r={key_r}"
                code = (f"from multiprocessing.forkserver import main; main({listener.fileno()}, {alive_r}, "
                        f"{PRELOAD!r}{auth})")
                self.proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=fds, env=dict(env),
                                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                             stderr=subprocess.DEVNULL, start_new_session=True)
        except BaseException:  # no socket or no server: nothing of this root is left behind
            os.close(alive_w)
            with contextlib.suppress(OSError):
                os.unlink(address)
            with contextlib.suppress(OSError):
                os.rmdir(self.dir)
            raise
        finally:
            os.close(alive_r)
            if key_r is not None:
                os.close(key_r)
        self.server._forkserver_address, self.server._forkserver_alive_fd = address, alive_w
        self.server._forkserver_pid = self.proc.pid
        self.server.ensure_running = self._check  # type: ignore[method-assign]

    def _check(self) -> None:
        if self.proc.poll() is not None:
            raise EOFError("the warm launch root has exited")

    def start(self, argv: list[str], env: Mapping[str, str], stdout: IO[Any], stderr: IO[Any]) -> Any:
        from multiprocessing import get_context

        process = get_context("forkserver").Process(target=_warm_root, name="fxpipe-launch",
                                                    args=(argv, dict(env), _Fd(stdout.fileno()), _Fd(stderr.fileno())))
        return _popen(process, self.server)

    def close(self) -> None:
        fd, self.server._forkserver_alive_fd = self.server._forkserver_alive_fd, None
        if fd is not None:
            os.close(fd)  # the server leaves once its running forks (which let go of it) are gone too
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(self.dir, "socket"))
            os.rmdir(self.dir)


class _Fd:
    """A file descriptor for a fork server's fork: it gets a duplicate (multiprocessing's ``DupFd``)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, ...]:
        from multiprocessing import reduction

        return _detach, (reduction.DupFd(self.fd),)


def _detach(dup: Any) -> int:
    return int(dup.detach())


def _popen(process: Any, server: Any) -> Any:
    """Start ``process`` as a fork of ``server``: ``multiprocessing.popen_forkserver.Popen``, asking that server
    rather than multiprocessing's own. Only the preparation the fork needs goes with it: the working directory, not
    the launcher's ``__main__`` (which the fork would import) nor its ``sys.path``."""
    import io
    from multiprocessing import context, popen_forkserver, reduction, spawn, util
    from multiprocessing import forkserver as mp_forkserver

    class Popen(popen_forkserver.Popen):  # type: ignore[misc, name-defined]
        def _launch(self, process_obj: Any) -> None:
            prep = {k: v for k, v in spawn.get_preparation_data(process_obj._name).items()
                    if k not in ("init_main_from_path", "init_main_from_name", "sys_path", "sys_argv")}
            buf = io.BytesIO()
            context.set_spawning_popen(self)
            try:
                reduction.dump(prep, buf)
                reduction.dump(process_obj, buf)
            finally:
                context.set_spawning_popen(None)
            self.sentinel, w = server.connect_to_new_process(self._fds)
            _parent_w = os.dup(w)  # the fork's sentinel of this process, as multiprocessing keeps it
            self.finalizer = util.Finalize(self, util.close_fds, (_parent_w, self.sentinel))
            with open(w, "wb", closefd=True) as f:
                f.write(buf.getbuffer())
            self.pid = mp_forkserver.read_signed(self.sentinel)

    return Popen(process)


def _warm_root(argv: list[str], env: dict[str, str], stdout: int, stderr: int) -> None:
    """A launch's root, forked by a warm root: made what ``python -m fxpipe.cli.agent`` would be (a session of its
    own, the launch's output files, environment and temporary directory; SIGTERM when its parent goes), then
    :func:`_root` without the imports."""
    from multiprocessing import current_process, forkserver

    from fxpipe.cli.ranks import die_with_parent

    os.setsid()
    for fd, into in ((stdout, 1), (stderr, 2)):
        os.dup2(fd, into)
        os.close(fd)
    server = forkserver._forkserver
    if server._forkserver_alive_fd is not None:  # the warm root's: this launch asks a server of its own
        os.close(server._forkserver_alive_fd)
    server._forkserver_address = server._forkserver_alive_fd = None
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # from TMPDIR again: the launch's report directory
    current_process()._config.pop("tempdir", None)  # the launcher's: multiprocessing's own files go there too
    launcher = os.getppid()
    die_with_parent()
    _root(argv, launcher=launcher, imported=True)


def _short_dir() -> str | None:
    """A temporary directory whose paths fit a Unix socket's 107 bytes: the system's when ``TMPDIR`` is deeper."""
    if len(tempfile.gettempdir()) <= 60:
        return None
    return next((d for d in ("/tmp", "/var/tmp") if os.path.isdir(d) and os.access(d, os.W_OK)), None)


if __name__ == "__main__":
    main()
