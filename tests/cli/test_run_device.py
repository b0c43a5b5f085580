"""``fxpipe run --device cuda [--no-cuda-graphs]``: the ranks train on the GPU (the plan moved there by
Pipeline.to_device) as they do on the CPU. The refusals are in test_run_cli.py (they need no GPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests._helpers import fxpipe_cli, ok

# CPU and CUDA kernels round differently; the runs are float32.
TOL = {"rtol": 1e-4, "atol": 1e-5}


def _compiled(tmp_path: Path, name: str) -> Path:
    plan = tmp_path / name
    ok(fxpipe_cli("compile", name, "--stages", "2", "--out", plan))
    return plan


def _run(plan: Path, *args: str | Path) -> dict:
    return json.loads(ok(fxpipe_cli("run", plan, "--microbatches", "4", "--json", *args)).stdout)


@pytest.mark.parametrize(("name", "schedules"), [("mlp-tiny", ("1f1b",)), ("gpt-tiny", ("1f1b", "zb-h1"))])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_ranks_train_like_cpu_ranks(tmp_path: Path, name: str, schedules: tuple[str, ...]) -> None:
    """Two ranks on one GPU, eager and with CUDA graphs, each schedule: the CPU run's losses. gpt-tiny ties wte
    and lm_head across its stages and traces arange with device=cpu: both must follow the pipeline to the GPU.
    One CUDA run checkpoints every step, and a run resumed from its last one trains step 6 as the CPU did."""
    plan = _compiled(tmp_path, name)
    cpu = _run(plan, "--steps", "6", "--schedule", schedules[0])
    assert cpu["device"] == "cpu" and cpu["cuda_graphs"] is False and cpu["cuda_graph_calls"] is None
    ckpt = tmp_path / "ckpt"
    for schedule in schedules:
        for graphs in (False, True):
            extra = ["--checkpoint-dir", ckpt] if (schedule, graphs) == (schedules[-1], False) else []
            doc = _run(plan, "--steps", "5", "--schedule", schedule, "--device", "cuda",
                       *([] if graphs else ["--no-cuda-graphs"]), *extra)  # graphs: the default on CUDA
            where = f"{name} {schedule}{' cuda graphs' if graphs else ''}"
            assert doc["device"] == "cuda" and doc["cuda_graphs"] is graphs, where
            torch.testing.assert_close(doc["losses"], cpu["losses"][:5], **TOL, msg=lambda m: f"{where}: {m}")
            if graphs:  # captured in step 2, replayed after it, no call fell back to eager
                assert doc["cuda_graph_calls"]["captured"] > 0, (where, doc["cuda_graph_calls"])
                assert doc["cuda_graph_calls"]["fallbacks"] == 0, (where, doc["cuda_graph_calls"])
    resumed = _run(plan, "--steps", "6", "--schedule", schedules[-1], "--device", "cuda", "--checkpoint-dir", ckpt,
                   "--resume", "always")
    torch.testing.assert_close(resumed["losses"], cpu["losses"][5:], **TOL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_replicas_train_like_cpu_replicas(tmp_path: Path) -> None:
    """--dp 2: four ranks on one GPU, each stage's gradients averaged over its two replicas (gloo, CUDA tensors)."""
    plan = _compiled(tmp_path, "mlp-tiny")
    cpu = _run(plan, "--steps", "3", "--dp", "2")
    doc = _run(plan, "--steps", "3", "--dp", "2", "--device", "cuda")
    assert doc["ranks"] == 4 and doc["dp"] == 2
    torch.testing.assert_close(doc["losses"], cpu["losses"], **TOL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_ranks_hand_their_weights_to_the_held_out_score(tmp_path: Path) -> None:
    """Real data: every rank's final weights gathered to rank 0 (as CPU tensors) and scored on the held-out split."""
    pytest.importorskip("sklearn")
    plan = _compiled(tmp_path, "mlp-small")
    cpu = _run(plan, "--steps", "3", "--data", "digits")
    doc = _run(plan, "--steps", "3", "--data", "digits", "--device", "cuda")
    torch.testing.assert_close(doc["losses"], cpu["losses"], **TOL)
    assert doc["held_out"]["samples"] == cpu["held_out"]["samples"] > 0
    assert abs(doc["held_out"]["held-out accuracy %"] - cpu["held_out"]["held-out accuracy %"]) <= 1.0


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL: a GPU per rank)")
def test_ranks_with_a_gpu_each_train_over_nccl_like_one_process(tmp_path: Path) -> None:
    """Two ranks, two GPUs: NCCL carries the messages GPU to GPU in the order both ranks derive (tag-blind), and
    training equals one process; each schedule kind (fused BW, split B/W, interleaved) once."""
    from tests._helpers import reference_losses

    plan = _compiled(tmp_path, "gpt-tiny")
    four = tmp_path / "gpt-tiny-4"
    ok(fxpipe_cli("compile", "gpt-tiny", "--stages", "4", "--out", four))  # interleaved: two stages per rank
    expected = reference_losses(3, 4, model="gpt-tiny")
    for schedule, target in (("1f1b", plan), ("zb-h1", plan), ("interleaved-1f1b", four)):
        doc = _run(target, "--steps", "3", "--schedule", schedule, "--device", "cuda", "--nproc", "2")
        assert doc["backend"] == "nccl" and doc["ranks"] == 2, (schedule, doc["backend"])
        torch.testing.assert_close(doc["losses"], expected, **TOL, msg=lambda m: f"{schedule}: {m}")
