"""``PipelineRuntime(plan_dir, optimizer=...)`` in a user's own multi-process script: the issue's API shape."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from fxpipe import models
from fxpipe.cli.main import app
from fxpipe.cli.rank_common import synthetic_batch
from tests._helpers import HANG_S, Forked
from tests.runtime._one_rank import run_one_rank

WORKER = Path(__file__).with_name("_api_worker.py")
ROOT = Path(__file__).parents[2]


def _run(tmp_path: Path, plan: Path, world: int, cfg: dict) -> list[dict]:
    procs = [Forked([str(WORKER), str(r), str(world), f"file://{tmp_path / 'pg'}", str(plan), str(tmp_path),
                     json.dumps(cfg)]) for r in range(world)]
    for p in procs:
        _, err = p.communicate(timeout=HANG_S)
        assert p.returncode == 0, err[-3000:]
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _one_process(name: str, steps: int = 3) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same training in one process: Adam, the loss averaged over the same 4 microbatches."""
    zoo = models.build(name, dtype=torch.float64)
    ref = copy.deepcopy(zoo.model)
    opt = torch.optim.Adam(ref.parameters(), lr=1e-3)
    inputs, target = synthetic_batch(zoo, 4)
    xs, ts = [x.tensor_split(4) for x in inputs], target.tensor_split(4)
    losses = []
    for _ in range(steps):
        loss = sum(zoo.loss_fn(ref(*(x[i] for x in xs)), ts[i]) for i in range(4)) / 4
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses, dict(ref.named_parameters(remove_duplicate=False))


def _compare(ranks: list[dict], losses: list[float], expected: dict[str, torch.Tensor]) -> None:
    seen = set()
    for r in ranks:
        assert r["losses"] == pytest.approx(losses, rel=1e-9)
        for name, value in r["state"]["params"].items():
            torch.testing.assert_close(value.cpu(), expected[name].detach(), msg=lambda m, name=name: f"{name}: {m}")
            seen.add(name)
    assert {id(expected[n]) for n in seen} == {id(p) for p in expected.values()}


@pytest.mark.parametrize(("compile_args", "cfg", "schedule", "per_rank"), [
    # The schedule recorded in the plan: interleaved, two stages (and two Adams) on each rank; no host settings asked.
    (["--stages", "4", "--schedule", "interleaved-1f1b", "--microbatches", "4"], {}, "interleaved-1f1b", 2),
    # A schedule named at run time, and fxpipe run's host settings asked for (HostTuning.for_runs()).
    (["--stages", "2"], {"schedule": "zb-h2", "microbatches": 4,
                         "host": {"pin_cpus": True, "gloo_loop_nice": 19, "send_yield": "auto",
                                  "keep_freed_memory": True}}, "zb-h2", 1),
    # Receives posted just in time (one action ahead), into new buffers; only the yield after a send asked for.
    (["--stages", "2"], {"schedule": "1f1b", "microbatches": 4, "prefetch": 1, "host": {"send_yield": "on"}},
     "1f1b", 1),
])
def test_a_plan_directory_trains_like_one_process(tmp_path: Path, compile_args: list[str], cfg: dict,
                                                  schedule: str, per_rank: int) -> None:
    plan = tmp_path / "plan"
    result = CliRunner().invoke(app, ["compile", "mlp-tiny", "--dtype", "float64", *compile_args, "--out", str(plan)])
    assert result.exit_code == 0, result.output
    ranks = _run(tmp_path, plan, 2, {"model": "mlp-tiny", **cfg})
    losses, expected = _one_process("mlp-tiny")
    assert all(r["schedule"] == schedule for r in ranks)
    _compare(ranks, losses, expected)
    # One optimizer per stage that holds parameters: some rank steps per_rank of them.
    assert max(len(r["optimizers"]) for r in ranks) == per_rank
    _check_process_state(ranks, cfg.get("host"))


def _check_process_state(ranks: list[dict], host: dict | None) -> None:
    """The library changes the process only where asked: every thread's niceness and CPU affinity are as the rank
    found them, after the runtime was made and stepped, so is the environment, and fxpipe's mallopt wrapper was not
    called; asked
    (``host=HostTuning(...)``), gloo's socket threads run at its niceness, each rank on its CPU, freed memory kept."""
    host = host or {}
    for rank, r in enumerate(ranks):
        found, after = r["found"], r["after"]
        assert after["environ"] == found["environ"]
        main_nice, main_cpus = found["nice"][min(found["nice"])], found["cpus"][min(found["cpus"])]
        assert set(found["nice"].values()) == {main_nice}  # as the rank found its process: one niceness, one CPU set
        assert all(c == main_cpus for c in found["cpus"].values())
        loops = set(r["loop_priorities"])
        assert loops, "a gloo process group runs a socket thread"
        others = {tid: n for tid, n in after["nice"].items() if n != main_nice}
        if host.get("gloo_loop_nice"):
            assert loops == {host["gloo_loop_nice"]} and r["gloo_loops"] == len(r["loop_priorities"])
            assert len(others) == len(r["loop_priorities"])  # those threads only
        else:
            assert loops == {main_nice} and r["gloo_loops"] == 0 and others == {}
        cpus = {tuple(c) for c in after["cpus"].values()}
        if host.get("pin_cpus") and len(main_cpus) >= 2:
            from fxpipe.calibration.threads import rank_cpus

            assert cpus == {rank_cpus(rank, 2, set(main_cpus))}
        else:
            assert cpus == {tuple(main_cpus)}
        assert r["mallopts"] == (1 if host.get("keep_freed_memory") else 0)
        # each send yields the core once, so gloo's socket thread sends it (mlp-tiny's actions are short), if asked
        assert r["send_yield"] is (host.get("send_yield", "off") != "off")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("name", "schedule"), [("mlp-tiny", "zb-h1"), ("gpt-tiny", "zb-h1"), ("gpt-medium", "1f1b")])
def test_two_ranks_on_one_gpu_train_like_one_process(tmp_path: Path, name: str, schedule: str) -> None:
    """CUDA through gloo: pinned staging buffers on a communication stream, events against the compute stream.

    gpt-medium under 1f1b: messages large enough that a device-to-host copy is still running when the
    sender blocks on its next receive; a send held back there deadlocked both ranks (fixed in Channel.wait)."""
    ranks = _run(tmp_path, tmp_path / "unused", 2, {"model": name, "device": "cuda", "schedule": schedule,
                                                     "microbatches": 4})
    losses, expected = _one_process(name)
    _compare(ranks, losses, expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("name", "schedule"), [("mlp-tiny", "zb-h1"), ("gpt-tiny", "1f1b"), ("gpt-tiny", "zb-h2")])
def test_cuda_graphs_on_two_ranks_train_like_one_process(tmp_path: Path, name: str, schedule: str) -> None:
    """cuda_graphs=True: step 1 eager, step 2 captures every F, B, W, W_acc and W_set call slot, steps 3-5 replay;
    the losses and the parameters after Adam equal one process's (float64), and no call fell back to eager."""
    ranks = _run(tmp_path, tmp_path / "unused", 2, {"model": name, "device": "cuda", "schedule": schedule,
                                                     "microbatches": 4, "cuda_graphs": True, "steps": 5})
    losses, expected = _one_process(name, steps=5)
    _compare(ranks, losses, expected)
    for r in ranks:
        assert r["graphs"]["captured"] > 0 and r["graphs"]["fallbacks"] == 0, r["graphs"]


def test_cuda_graphs_need_a_cuda_rank(tmp_path: Path) -> None:
    plan = tmp_path / "plan"
    result = CliRunner().invoke(app, ["compile", "mlp-tiny", "--stages", "1", "--out", str(plan)])
    assert result.exit_code == 0, result.output
    stdout = run_one_rank(tmp_path, f"""
        for codegen in ('eager', 'inductor'):
            try:
                PipelineRuntime({str(plan)!r}, loss_fn=lambda out, t: out.sum(), cuda_graphs=True, codegen=codegen)
            except OptionError as exc:
                print('refused:', exc)
        print('default on the CPU:', PipelineRuntime({str(plan)!r}, loss_fn=lambda out, t: out.sum()).graph_set)
        """)
    assert "refused: cuda_graphs=True needs the rank on a CUDA device (device: cpu)" in stdout
    assert "default on the CPU: None" in stdout  # CUDA graphs are the default on CUDA ranks only
    from fxpipe._compat import cpp_compiler

    if cpp_compiler() is not None:  # without one, codegen='inductor' runs eagerly (one warning) and is not refused
        assert "refused: cuda_graphs=True replays the eager stage graphs; with codegen='inductor'" in stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_call_that_cannot_be_captured_runs_eagerly(tmp_path: Path) -> None:
    """CUDA graphs are the default on a CUDA rank; a call whose capture fails (as one that syncs with the host
    does) runs eagerly at every step, with one warning, and training equals cuda_graphs=False's (float64)."""
    stdout = run_one_rank(tmp_path, """
        import json, logging
        import fxpipe
        from fxpipe import models
        from fxpipe.cli.rank_common import synthetic_batch

        def train(cuda_graphs, fail):
            zoo = models.build('mlp-tiny', dtype=torch.float64, device='cuda')
            pipe = fxpipe.compile(zoo.model, zoo.example_inputs, stages=1)
            rt = PipelineRuntime(pipe, loss_fn=zoo.loss_fn, optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-3),
                                 microbatches=4, cuda_graphs=cuda_graphs)
            if fail:  # stage 0's F: its capture raises, as an op that syncs with the host makes it
                member = rt.graph_set.members[0]
                real = member.fn

                def forward(*args):
                    if torch.cuda.is_current_stream_capturing():
                        raise RuntimeError('operation not permitted when stream is capturing')
                    return real(*args)
                member.fn = forward
            inputs, target = synthetic_batch(models.build('mlp-tiny', dtype=torch.float64), 4)
            said = []
            handler = logging.Handler(logging.WARNING)
            handler.emit = lambda record: said.append(record.getMessage())
            logging.getLogger('fxpipe').addHandler(handler)
            losses = [float(rt.step(inputs, target)) for _ in range(5)]
            logging.getLogger('fxpipe').removeHandler(handler)
            gs = rt.graph_set
            return {'losses': losses, 'graphs': None if gs is None else [gs.captured, gs.fallbacks, len(gs.failed)],
                    'warned': sum('could not be captured' in message for message in said)}
        print(json.dumps([train(False, False), train(None, True), train(None, False)]))
        """)
    eager, failing, graphed = json.loads(stdout.strip().splitlines()[-1])
    assert eager["graphs"] is None
    torch.testing.assert_close(failing["losses"], eager["losses"])
    torch.testing.assert_close(graphed["losses"], eager["losses"])
    # 4 F slots fail at step 2's capture and run eagerly then and at steps 3-5: 16 eager calls, one warning
    captured, fallbacks, failed = failing["graphs"]
    assert (failed, fallbacks, failing["warned"]) == (4, 16, 1) and captured > 0
    assert graphed["graphs"][0] > 0 and graphed["graphs"][1:] == [0, 0] and graphed["warned"] == 0


@pytest.mark.parametrize("fails", [False, True])
def test_a_process_group_the_runtime_started_is_destroyed_at_exit(tmp_path: Path, fails: bool) -> None:
    """A script like the README's recipe, which never calls destroy_process_group: the runtime started the group,
    and destroys it at exit while the interpreter is whole (gloo's threads freeing work objects during
    finalization can abort the process). After an unhandled exception it is left alone: destroying it could
    wait on a dead peer, where exiting lets torchrun stop the others."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    script = tmp_path / "train.py"
    script.write_text(
        "import atexit, torch.distributed as dist\n"
        "atexit.register(lambda: print('initialized at exit:', dist.is_initialized(), flush=True))  # runs last\n"
        "import fxpipe\n"
        "from fxpipe import models\n"
        "from fxpipe.runtime import PipelineRuntime\n"
        "zoo = models.build('mlp-tiny')\n"
        "rt = PipelineRuntime(fxpipe.compile(zoo.model, zoo.example_inputs, stages=1), loss_fn=zoo.loss_fn)\n"
        "print('initialized:', dist.is_initialized(), flush=True)\n"
        + ("raise RuntimeError('the script failed')\n" if fails else ""))
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=HANG_S)
    assert proc.returncode == (1 if fails else 0), proc.stderr[-2000:]
    assert "initialized: True" in proc.stdout
    assert f"initialized at exit: {fails}" in proc.stdout, proc.stdout
