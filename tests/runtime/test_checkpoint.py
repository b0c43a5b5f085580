"""Checkpoints: DCP directories, one per step, complete only when every rank's part is in, read as data.

The file-level rules run in this process on a one-rank stand-in for the runtime (DCP without a
process group); the rules that need ranks to agree run in two launches of real ranks.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import pickletools
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from fxpipe.errors import CheckpointError, FxpipeError
from fxpipe.runtime import checkpoint
from tests._helpers import (
    OneRank as _OneRank,
    assert_ranks_ok,
    launch_ranks,
    load_checkpoints as _load,
    saved_checkpoints as _saved,
    train_reference,
    with_plans,
)
from tests.runtime._dist_worker import payload


def test_one_directory_per_step_keeps_the_last_k_and_loads_back(tmp_path: Path) -> None:
    root = _saved(tmp_path / "ck", range(1, 6), keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["step_000004", "step_000005"]
    assert sorted(p.name for p in (root / "step_000005").iterdir()) == [
        ".metadata", "__0_0.distcp", "fxpipe-checkpoint.json"]
    info = json.loads((root / "step_000005" / checkpoint.MARKER).read_text())
    assert info["schema"] == "fxpipe.checkpoint/v1" and info["step"] == 5 and info["world"] == 1
    step, warned, rt = _load(root)
    assert step == 5 and warned == [] and rt.loaded is not None
    assert torch.equal(rt.loaded["params"]["a.weight"], torch.full((2, 3), 5.0, dtype=torch.float64))
    assert torch.equal(rt.loaded["optim"]["a.weight"]["momentum_buffer"], torch.full((2, 3), 10.0, dtype=torch.float64))
    assert rt.loaded["optim"]["a.weight"]["step"] == 7 and isinstance(rt.loaded["optim"]["a.weight"]["step"], int)
    assert rt.loaded["param_groups"] == [{"params": ["a.weight"], "lr": 0.1, "betas": [0.9, 0.99], "foreach": None}]
    # The same step again (a resumed run) replaces it whole; keep must be at least 1.
    checkpoint.save(_OneRank(50.0), root, 5, keep=2)
    assert _load(root)[2].loaded["params"]["a.weight"][0, 0] == 50.0  # type: ignore[index]
    with pytest.raises(FxpipeError, match="keep is how many"):
        checkpoint.save(_OneRank(1.0), root, 6, keep=0)


def test_resume_passes_over_newer_incomplete_or_truncated_steps_and_says_why(tmp_path: Path) -> None:
    root = _saved(tmp_path / "ck", range(1, 5), keep=4)
    data = root / "step_000004" / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:100])
    (root / "step_000003" / checkpoint.MARKER).unlink()  # rank 0 died before marking it complete
    (root / ".step_000005.partial").mkdir()  # a save under way, or one that never finished
    step, warned, _ = _load(root)
    assert step == 2
    assert warned == [
        "step_000004 is truncated (__0_0.distcp has 100 of "
        f"{json.loads((root / 'step_000004' / checkpoint.MARKER).read_text())['files']['__0_0.distcp']} bytes); "
        "resuming from step_000002",
        "step_000003 is incomplete (no fxpipe-checkpoint.json); resuming from step_000002",
        ".step_000005.partial is incomplete (a save that did not finish); resuming from step_000002"]
    for p in root.iterdir():
        if p.name != "step_000001":
            shutil.rmtree(p)
    (root / "step_000001" / ".metadata").write_bytes(b"\x80\x04garbage")
    with pytest.raises(CheckpointError, match=r"^no complete checkpoint in .*step_000001 is corrupt \(\.metadata does "
                                              r"not load: .*\); start without --resume$"):
        _load(root)
    with pytest.raises(CheckpointError, match=r"does not exist\); start without --resume"):
        _load(tmp_path / "nowhere")
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "rank0.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match="rank0.pt is of fxpipe's old per-rank format, which is no longer loaded"):
        _load(tmp_path / "old")


@pytest.mark.parametrize("change", [{"world": 10**9}, {"step": 1}, {"files": {"../x": 1}},
                                    {"param_groups": [{"params": ["a.weight"], "lr": {"x": 1}}]}, {"schema": "v0"}])
def test_a_json_record_that_does_not_describe_its_step_is_passed_over(tmp_path: Path, change: dict[str, Any]) -> None:
    root = _saved(tmp_path / "ck", range(1, 3))
    marker = root / "step_000002" / checkpoint.MARKER
    marker.write_text(json.dumps({**json.loads(marker.read_text()), **change}))
    step, warned, _ = _load(root)
    assert step == 1 and len(warned) == 1 and warned[0].startswith("step_000002 is corrupt (fxpipe-checkpoint.json ")


def test_metadata_is_read_by_an_unpickler_that_knows_only_dcp_classes(tmp_path: Path) -> None:
    root = _saved(tmp_path / "ck", range(1, 2))
    data = (root / "step_000001" / ".metadata").read_bytes()
    # Every global a real file names is on the allow-list (and nothing of builtins, os or subprocess is).
    named: set[tuple[str, str]] = set()

    class Recording(pickle.Unpickler):  # our own file, just written: safe to load with plain pickle
        def find_class(self, module: str, name: str) -> Any:
            named.add((module, name))
            return super().find_class(module, name)

    Recording(io.BytesIO(data)).load()
    assert any(op.name == "STACK_GLOBAL" for op, _, _ in pickletools.genops(data))
    assert named and named <= checkpoint._METADATA_GLOBALS
    assert not {m for m, _ in checkpoint._METADATA_GLOBALS} & {"builtins", "os", "posix", "subprocess", "sys"}
    md = checkpoint.read_metadata(root / "step_000001" / ".metadata")
    assert set(md.state_dict_metadata) == {"model.a.weight", "model.bn.running_mean",
                                           "optim.state.a.weight.momentum_buffer", "optim.number.a.weight.step",
                                           "fxpipe.step.rank0"}


@pytest.mark.parametrize("name", [".metadata", "__0_0.distcp", "fxpipe-checkpoint.json"])
@pytest.mark.parametrize("padded", [False, True], ids=["as-is", "padded-to-size"])
def test_a_pickle_payload_in_any_checkpoint_file_runs_no_code(tmp_path: Path, name: str, padded: bool) -> None:
    root, ran = _saved(tmp_path / "ck", range(1, 3)), tmp_path / "code-ran"
    file = root / "step_000002" / name
    file.write_bytes(payload(ran).ljust(file.stat().st_size if padded else 0, b"\0"))
    try:
        step, warned, _ = _load(root)
    except CheckpointError as exc:  # refused: one line naming the file and the fix
        assert "\n" not in str(exc) and str(file) in str(exc) and "it could run code" in str(exc)
        assert f"remove {root / 'step_000002'} to resume from the step before" in str(exc)
    else:  # or passed over as damaged, never read as code
        assert step == 1 and len(warned) == 1 and warned[0].startswith("step_000002 is ")
    assert not ran.exists()
    # The metadata file is refused outright, in both cases: a tampered file is not silently passed over.
    if name == ".metadata":
        with pytest.raises(CheckpointError, match=r"refers to posix\.system, which DCP's metadata never does"):
            _load(root)


def test_pickled_bytes_are_refused_behind_the_metadata_unpickler_too(tmp_path: Path) -> None:
    """DCP would ``torch.load(weights_only=False)`` a value it saved as bytes. The metadata unpickler already refuses
    the class naming one (``BytesStorageMetadata`` is not on its allow-list); behind it, an index listing one is
    refused, and the load planner refuses the bytes themselves without unpickling them."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    assert ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata") not in checkpoint._METADATA_GLOBALS
    problem = checkpoint._metadata_problem(Metadata(state_dict_metadata={"x": BytesStorageMetadata()},
                                                         storage_data={}))
    assert problem == "lists 'x' as a BytesStorageMetadata: fxpipe checkpoints hold tensors only"
    ran = tmp_path / "code-ran"
    _, planner = checkpoint._dcp_classes()
    item = ReadItem(type=LoadItemType.BYTE_IO, dest_index=MetadataIndex("x"), dest_offsets=torch.Size([]),
                    storage_index=MetadataIndex("x"), storage_offsets=torch.Size([]), lengths=torch.Size([]))
    with pytest.raises(CheckpointError, match=r"holds x as pickled bytes, which fxpipe never writes; .*could run code"):
        planner().load_bytes(item, io.BytesIO(payload(ran)))
    assert not ran.exists()


def test_files_of_different_steps_are_refused(tmp_path: Path) -> None:
    root = _saved(tmp_path / "ck", range(1, 3))
    shutil.copyfile(root / "step_000001" / "__0_0.distcp", root / "step_000002" / "__0_0.distcp")
    marker = root / "step_000002" / checkpoint.MARKER  # its checksum recorded too: only the step keys tell
    info = json.loads(marker.read_text())
    info["sha256"]["__0_0.distcp"] = checkpoint.sha256_file(root / "step_000002" / "__0_0.distcp")
    marker.write_text(json.dumps(info))
    with pytest.raises(CheckpointError, match=r"step_000002 mixes steps: its rank files are of steps rank 0: 1, its "
                                              r"index of step 2; it was not loaded; remove it"):
        _load(root)


def test_a_checkpoint_of_another_model_is_refused(tmp_path: Path) -> None:
    root = _saved(tmp_path / "ck", range(1, 2))
    with pytest.raises(CheckpointError, match=r"is of another model: it lacks b\.weight and holds a\.weight, which "
                                              r"this plan does not; resume with a plan of the model it was saved from"):
        checkpoint.load(_OneRank(0.0, name="b.weight"), root)


def test_optimizer_state_that_is_not_tensors_or_numbers_is_not_saved(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="optimizer state 'note' of a.weight is a str; fxpipe checkpoints hold "
                                              "tensors and numbers only"):
        checkpoint.save(_OneRank(1.0, extra={"note": "x"}), tmp_path / "ck", 1)


def test_clear_removes_only_the_step_directories_fxpipe_wrote(tmp_path: Path) -> None:
    root = _saved(tmp_path / "ck", range(1, 3))
    (root / "NOTES.txt").write_text("mine")
    (root / "logs").mkdir()
    (root / "step_000009").mkdir()
    (root / "step_000001" / "mine.txt").write_text("mine")  # a user's file inside a step: nothing is removed
    with pytest.raises(CheckpointError, match=r"step_000001 holds mine\.txt, which fxpipe did not write; nothing was "
                                              "removed: move it out, or use another checkpoint directory"):
        checkpoint.clear(root)
    assert sorted(p.name for p in root.iterdir()) == ["NOTES.txt", "logs", "step_000001", "step_000002", "step_000009"]
    (root / "step_000001" / "mine.txt").rename(root / "mine.txt")
    assert checkpoint.clear(root) == ["step_000001", "step_000002", "step_000009"]
    assert sorted(p.name for p in root.iterdir()) == ["NOTES.txt", "logs", "mine.txt"]


# -- real ranks -------------------------------------------------------------------------------


def test_ranks_agree_on_every_checkpoint_case(tmp_path: Path) -> None:
    """One launch of 2 ranks (gpt-tiny: a weight tied across ranks, SGD with momentum) saves steps 1-3,
    keeping 2; rank 0 damages the files case after case and both ranks load: both get the same answer,
    the errors are one line, and no file's payload runs."""
    results = launch_ranks(tmp_path, 2, {"checkpoint_cases": True})
    assert_ranks_ok(results)
    ranks = [json.loads((tmp_path / f"cases-rank{r}.json").read_text()) for r in range(2)]
    cases = ranks[0]
    assert cases["listing"] == ["step_000002", "step_000003"]
    for name, result in cases.items():  # the ranks agree (warnings come on rank 0 only)
        other = ranks[1][name]
        assert (result["got"] if isinstance(result, dict) else result) == (
            other["got"] if isinstance(other, dict) else other), name
    assert cases["newest"] == {"got": 3, "warned": []}
    assert cases["truncated"]["got"] == 2
    assert cases["truncated"]["warned"][0].startswith("step_000003 is truncated (__1_0.distcp has ")
    assert cases["partial"] == {"got": 3, "warned": [".step_000004.partial is incomplete (a save that did not "
                                                     "finish); resuming from step_000003"]}
    assert cases["mixed"]["got"].startswith("error: ") and "step_000003 mixes steps: its rank files are of steps " \
        "rank 0: 3, rank 1: 2, its index of step 3" in cases["mixed"]["got"]
    assert "refers to posix.system" in cases["payload .metadata"]["got"]
    # a payload the size of the data file it replaces: its checksum differs, so it is never read
    assert cases["payload __0_0.distcp"]["got"].startswith("error: no complete checkpoint in ")
    assert "step_000003 is corrupt (__0_0.distcp does not match the checksum" in cases["payload __0_0.distcp"]["got"]
    assert cases["payload fxpipe-checkpoint.json"]["got"].startswith("error: no complete checkpoint in ")
    assert cases["code ran"] is False and not (tmp_path / "code-ran").exists()
    assert cases["different steps"]["got"] == ("error: the ranks save different steps (rank 0: 10, rank 1: 11); a "
                                               "checkpoint is one step of every rank: call save_checkpoint with the "
                                               "same step on every rank")
    for result in cases.values():
        if isinstance(result, dict) and isinstance(result["got"], str):
            assert "\n" not in result["got"]


def test_a_two_stage_checkpoint_resumes_under_three_stages(tmp_path: Path) -> None:
    """gpt-tiny trains 2 steps on 2 stages and saves (asynchronously: ``dcp.async_save``, completed before the ranks
    end); 3 ranks of a 3-stage plan resume from it (each loads its own stages' keys through ``set_state_dict``, the
    tied weight on two ranks). Their next 2 steps equal, bit for bit, a 3-stage run started from the 2-stage ranks'
    final states, and a single process's steps 3 and 4. The ranks load the session's compiled plans
    (test_ranks_agree_on_every_checkpoint_case's compile on the ranks)."""
    two, three, ck = tmp_path / "two", tmp_path / "three", tmp_path / "ck"
    two.mkdir(), three.mkdir()
    base = {"model": "gpt-tiny", "schedules": ["1f1b"], "microbatches": 4}
    assert_ranks_ok(launch_ranks(two, 2, with_plans(2, {**base, "steps": 2, "checkpoint": str(ck),
                                                        "checkpoint_after": 2, "async_checkpoint": True})))
    info = json.loads((ck / "step_000002" / checkpoint.MARKER).read_text())
    assert info["world"] == 2 and info["stages"] == 2
    states = [str(two / f"1f1b-rank{r}.pt") for r in range(2)]
    assert_ranks_ok(launch_ranks(three, 3, with_plans(3, {**base, "steps": 4, "resume": str(ck), "load_state": states,
                                                          "load_state_step": 2})))
    reference, _ = train_reference("gpt-tiny", 4, 4)
    for rank in range(3):
        resumed = torch.load(three / f"1f1b-rank{rank}.pt", weights_only=True)
        started = torch.load(three / f"1f1b-load_state-rank{rank}.pt", weights_only=True)
        assert resumed["losses"] == started["losses"], rank  # the same floats
        assert resumed["losses"] == pytest.approx(reference[2:], rel=1e-9)
        for key in ("params", "buffers"):
            for name, value in resumed["state"][key].items():
                assert torch.equal(value, started["state"][key][name]), name
        for name, values in resumed["state"]["optim"].items():
            assert torch.equal(values["momentum_buffer"], started["state"]["optim"][name]["momentum_buffer"]), name
    assert os.listdir(ck) == ["step_000002"]  # resuming does not write
