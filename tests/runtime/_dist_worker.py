"""Worker for the multi-process runtime tests: one rank trains a model on its stages, then saves its parameters."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parents[2]))  # run as a script: make `tests` importable


def build(model: str, m: int) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...], torch.Tensor, Any]:
    """A model in float64 with a batch of 2 per microbatch: a zoo name, ``skip-tied`` or ``batch-mix``."""
    if model == "batch-mix":
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(8, 16), BatchCentre(), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                                  torch.nn.Tanh(), torch.nn.Linear(16, 4)).double()
        gen = torch.Generator().manual_seed(1)
        x, y = torch.randn(2 * m, 8, generator=gen, dtype=torch.float64), torch.randn(2 * m, 4, generator=gen,
                                                                                       dtype=torch.float64)
        return net, (x,), y, torch.nn.functional.mse_loss
    if model == "skip-tied":
        from tests._helpers import SkipTied, token_ce

        torch.manual_seed(0)
        net = SkipTied().double()
        gen = torch.Generator().manual_seed(1)
        inputs = (torch.randint(0, 32, (2 * m, 5), generator=gen),)
        return net, inputs, torch.randint(0, 32, (2 * m, 5), generator=gen), token_ce
    from fxpipe import models

    zoo = models.build(model, dtype=torch.float64, batch_size=m * 2)
    return zoo.model, zoo.example_inputs, zoo.example_target, zoo.loss_fn


class BatchCentre(torch.nn.Module):
    """``x - x.mean(0)``: mixes a batch's samples, so a gradient over k microbatches at once is not the sum of the
    per-microbatch ones (batched W must notice and run per microbatch)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(0)


def die_mid_step(rt: Any, rank: int, cfg: dict[str, Any], out: str) -> Callable[[int], None]:
    """``kill_rank``: SIGKILL this process right after its ``kill_at``-th compute action (F, B, W or BW) of
    step ``kill_step`` (default 1), counting from 1, before that action's sends go out; ``kill_at`` -1 is
    the step's last action (after it come only the step's send completions and sums), 0 the step's start.
    The moment of death (``time.time()``) is written to ``OUT/killed-rank{R}`` first.

    The runtime's executor core's ``run`` (one compute action) is wrapped to count. Returns the function the
    training loop calls at the start of each step.
    """
    if rank != cfg.get("kill_rank", -1):
        return lambda step: None
    state = {"step": -1, "acts": 0, "per_step": 0}
    at, when = cfg.get("kill_at", 1), cfg.get("kill_step", 1)

    def die() -> None:
        (Path(out) / f"killed-rank{rank}").write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)

    act = rt.core.run  # the bound method: the wrapper below shadows it on this instance only

    def counted(*args: Any, **kwargs: Any) -> Any:
        result = act(*args, **kwargs)
        state["acts"] += 1
        if state["step"] == when and state["acts"] == (state["per_step"] if at == -1 else at):
            die()
        return result

    rt.core.run = counted

    def start(step: int) -> None:
        state["per_step"] = max(state["per_step"], state["acts"])  # every step runs the same actions
        state["step"], state["acts"] = step, 0
        if step == when and at == 0:
            die()

    return start


def merged_state(files: list[str]) -> dict[str, Any]:
    """Every rank's ``state_dict()`` (as this worker saved them) merged into one: what a rank of any plan loads from."""
    merged: dict[str, Any] = {"params": {}, "buffers": {}, "optim": {}, "param_groups": []}
    for file in files:
        state = torch.load(file, weights_only=True)["state"]
        for key in ("params", "buffers", "optim"):
            merged[key].update(state[key])
        merged["param_groups"] += state["param_groups"]
    return merged


def granularity_of(cfg: dict[str, Any], stages: int, positions: int) -> str:
    """The granularity a case compiles ``stages`` stages with: two stages per rank can need more layers than the
    blocks give (cut between nodes), else the case's own (default auto)."""
    return "node" if stages > positions else cfg.get("granularity", "auto")


def train(rank: int, world: int, init: str, out: str, cfg: dict[str, Any]) -> None:
    """Train one case (``cfg``), or with ``cfg["cases"]`` ({name: case}) each case in turn on the same ranks, case
    ``name`` writing its files into ``OUT/name`` (one launch, many cases: the ranks start and join once)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=timedelta(seconds=cfg.get("pg_timeout", 20)))
    try:
        cases = cfg["cases"].items() if "cases" in cfg else [("", cfg)]
        for case, one in cases:
            (Path(out) / case).mkdir(exist_ok=True)
            train_case(rank, world, str(Path(out) / case), one)
            dist.barrier()
    finally:
        dist.destroy_process_group()


def train_case(rank: int, world: int, out: str, cfg: dict[str, Any]) -> None:
    """One case: every schedule of ``cfg["schedules"]`` trains the model from the same start and saves each rank's
    losses and state. The pipeline is compiled here (every rank compiles the whole model, as a user's script does),
    or with ``cfg["plans"]`` ({stages: plan directory}, compiled once by the test) loaded from a saved plan, as
    ``fxpipe run``'s ranks do."""
    import fxpipe
    from fxpipe.runtime.executor import PipelineRuntime
    from fxpipe.schedules.generators import generate
    from fxpipe.schedules.simulate import Costs

    m, dp = cfg["microbatches"], cfg.get("dp", 1)
    positions = world // dp  # pipeline ranks; each stage on dp replicas (the batch is dp times bigger)
    compiled: dict[int, Any] = {}
    for name in cfg["schedules"]:
        # interleaved-1f1b puts two stages on each rank; the others one.
        stages = 2 * positions if name == "interleaved-1f1b" else positions
        if stages not in compiled:
            model, inputs, target, loss_fn = build(cfg["model"], m * dp)
            example_inputs = tuple(x.tensor_split(m * dp)[0] for x in inputs)
            if cfg.get("plans"):
                pipe = fxpipe.load(cfg["plans"][str(stages)])  # each runtime splits the stages its schedule puts here
            else:
                pipe = fxpipe.compile(model, example_inputs, stages=stages,
                                      granularity=granularity_of(cfg, stages, positions))
            # the pipeline's own parameters and buffers (a compiled pipeline's are the model's)
            state = {k: v.detach().clone() for k, v in pipe.state_dict(keep_vars=True).items()}
            compiled[stages] = (inputs, target, loss_fn, pipe, state)
        inputs, target, loss_fn, pipe, state = compiled[stages]
        with torch.no_grad():  # every schedule starts from the same weights and statistics
            for k, v in pipe.state_dict(keep_vars=True).items():
                v.copy_(state[k])
        if name == "auto":
            from fxpipe.schedules.auto import auto

            sched = auto(stages, Costs.from_plan(pipe.plan), microbatches=[m]).schedule
        else:  # ``skew_rank``: that rank's schedule runs twice the microbatches (the runtime must refuse it)
            sched = generate(name, stages, m * (2 if rank == cfg.get("skew_rank") else 1), Costs.from_plan(pipe.plan))
        # Resumed from a checkpoint, and (``load_state``) again from the merged states an earlier
        # launch's ranks ended with: the same plan, two ways in.
        for start in ("resume", "load_state") if cfg.get("resume") and cfg.get("load_state") else ("",):
            mesh = None
            if cfg.get("mesh"):  # the user's own DeviceMesh (else the runtime lays out pp x dp itself)
                from torch.distributed.device_mesh import init_device_mesh

                mesh = init_device_mesh("cpu", (positions, dp), mesh_dim_names=("pp", "dp"))
            try:
                rt = PipelineRuntime(pipe, sched, loss_fn,
                                     optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
                                     timeout=timedelta(seconds=cfg.get("timeout", 10)), mesh=mesh,
                                     tag_blind=cfg.get("tag_blind", False))
                if cfg.get("perturb") and rank == 1:  # after the lowering's check: rank 1 posts its first two swapped
                    posts = rt.program.posts
                    posts[0], posts[1] = posts[1], posts[0]
            except Exception as exc:  # a refusal the test expects: its line, then the next schedule
                if not cfg.get("refused"):
                    raise
                (Path(out) / f"{name}-refused-rank{rank}.txt").write_text(f"{type(exc).__name__}: {exc}")
                continue
            starting = die_mid_step(rt, rank, cfg, out)
            first = 0
            if cfg.get("resume") and start != "load_state":
                first = rt.load_checkpoint(cfg["resume"])
            elif cfg.get("load_state"):
                rt.load_state_dict(merged_state(cfg["load_state"]))
                first = cfg["load_state_step"]
            losses = []
            for step in range(first, cfg["steps"]):
                if rank == cfg.get("fail_rank", -1) and step == 1:
                    raise ValueError(f"boom on rank {rank}")
                starting(step)
                losses.append(float(rt.step(inputs, target)))
                if cfg.get("checkpoint") and step + 1 == cfg.get("checkpoint_after"):
                    rt.save_checkpoint(cfg["checkpoint"], step + 1, asynchronous=cfg.get("async_checkpoint", False))
            rt.wait_checkpoint()  # an asynchronous save is completed before the run ends
            tag = f"-{start}" if start == "load_state" else ""
            torch.save({"losses": losses, "state": rt.state_dict(), "batched_w": rt.batched_w},
                       Path(out) / f"{name}{tag}-rank{rank}.pt")


def payload(marker: Path) -> bytes:
    """A pickle that, if anything unpickled it, would create ``marker`` (it runs ``os.system``)."""
    import pickle

    class Payload:
        def __reduce__(self) -> tuple[Any, ...]:
            return os.system, (f"touch {marker}",)

    return pickle.dumps(Payload())


def checkpoint_cases(rank: int, world: int, init: str, out: str, cfg: dict[str, Any]) -> None:
    """Many checkpoint cases in one launch: gpt-tiny (tied weights) on 2 stages saves steps 1-3 (keeping 2);
    then rank 0 damages the files in one way after another and every rank loads. Writes
    ``OUT/cases-rank{R}.json``: case -> the step loaded (and rank 0's warnings) or the error's line."""
    import shutil
    import warnings

    import fxpipe
    from fxpipe.errors import CheckpointError
    from fxpipe.runtime.executor import PipelineRuntime

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=30))
    try:
        model, inputs, target, loss_fn = build("gpt-tiny", 4)
        pipe = fxpipe.compile(model, tuple(x.tensor_split(4)[0] for x in inputs), stages=world)
        rt = PipelineRuntime(pipe, "1f1b", loss_fn, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
                             microbatches=4, timeout=timedelta(seconds=20))
        ck = Path(out) / "ck"
        for step in range(3):
            rt.step(inputs, target)
            rt.save_checkpoint(ck, step + 1, keep=2)
        results: dict[str, Any] = {"listing": sorted(p.name for p in ck.iterdir())}
        step2, step3 = ck / "step_000002", ck / "step_000003"
        saved = {p: p.read_bytes() for d in (step2, step3) for p in d.iterdir()}

        def case(name: str, damage: Callable[[], None], load: Callable[[], Any] | None = None) -> None:
            if rank == 0:
                damage()
            dist.barrier()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", RuntimeWarning)
                try:
                    got: Any = (load or (lambda: rt.load_checkpoint(ck)))()
                except CheckpointError as exc:
                    got = f"error: {exc}"
            results[name] = {"got": got, "warned": [str(w.message) for w in caught if w.category is RuntimeWarning]}
            dist.barrier()
            if rank == 0:  # undo: the saved steps as written, nothing else
                for d in ck.iterdir():
                    if d.name not in ("step_000002", "step_000003"):
                        shutil.rmtree(d)
                for p, data in saved.items():
                    p.write_bytes(data)
            dist.barrier()

        def truncate(file: Path) -> None:
            file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])

        case("newest", lambda: None)
        case("truncated", lambda: truncate(step3 / "__1_0.distcp"))
        case("partial", lambda: (ck / ".step_000004.partial").mkdir())
        def mix() -> None:  # step 2's rank-1 file in step 3, its checksum recorded too: only the step keys tell
            shutil.copyfile(step2 / "__1_0.distcp", step3 / "__1_0.distcp")
            info = json.loads((step3 / "fxpipe-checkpoint.json").read_text())
            info["sha256"]["__1_0.distcp"] = hashlib.sha256((step3 / "__1_0.distcp").read_bytes()).hexdigest()
            info["files"]["__1_0.distcp"] = (step3 / "__1_0.distcp").stat().st_size
            (step3 / "fxpipe-checkpoint.json").write_text(json.dumps(info))

        case("mixed", mix)
        marker = Path(out) / "code-ran"
        for name in (".metadata", "__0_0.distcp", "fxpipe-checkpoint.json"):
            def tamper(name: str = name) -> None:
                for d in (step2, step3):  # a payload the size of the file it replaces (so sizes match)
                    size = (d / name).stat().st_size
                    (d / name).write_bytes(payload(marker).ljust(size, b"\0"))
            case(f"payload {name}", tamper)
        results["code ran"] = marker.exists()
        case("different steps", lambda: None, lambda: str(rt.save_checkpoint(ck, 10 + rank)))
        (Path(out) / f"cases-rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    cfg = json.loads(sys.argv[5])
    main = checkpoint_cases if cfg.get("checkpoint_cases") else train
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], cfg)
    from _leave import leave  # this script's own directory is on sys.path

    leave()
