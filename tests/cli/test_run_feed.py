"""``fxpipe run --loss / --data``: a plan of the user's own model trains; every bad spec is one line before any rank
starts; each rank reads only what its stages consume (the middle stage's rank calls no data function)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from fxpipe import data
from fxpipe.errors import OptionError, TargetError
from fxpipe.targets import resolve_function
from tests._helpers import fxpipe_cli, ok, one_line_error

MODEL = '''
import json, os
import torch
from torch import nn

CALLS = {calls!r}
NOT_A_FUNCTION = 3


def build():
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    return model, (torch.randn(2, 4),)


def loss(out, target):
    return nn.functional.mse_loss(out, target)


def step_batch(k, ctx):
    g = torch.Generator().manual_seed(1000 * k + ctx.replica)
    return torch.randn(ctx.batch_size, 4, generator=g), torch.randn(ctx.batch_size, 3, generator=g)


def batches(ctx):
    """Records who asked for what, then streams one batch per step from ctx.start."""
    who = "rank" + os.environ["RANK"] if "RANK" in os.environ else "launcher"
    with open(os.path.join(CALLS, who + ".json"), "w") as f:
        json.dump({{"needs_inputs": ctx.needs_inputs, "needs_targets": ctx.needs_targets, "rank": ctx.rank,
                   "replica": ctx.replica, "replicas": ctx.replicas, "batch_size": ctx.batch_size,
                   "inputs": [[n, list(s), str(d)] for n, s, d in ctx.inputs]}}, f)
    return (step_batch(k, ctx) for k in range(ctx.start, ctx.steps))


def vector_loss(out, target):
    return (out - target) ** 2


def constant_loss(out, target):
    return torch.zeros(())


def raising_loss(out, target):
    raise ValueError("no loss here")


def wide(ctx):
    return [(torch.randn(ctx.batch_size, 5), torch.randn(ctx.batch_size, 3))]


def long_inputs(ctx):
    return [(torch.zeros(ctx.batch_size, 4, dtype=torch.long), torch.randn(ctx.batch_size, 3))]


def short_target(ctx):
    return [(torch.randn(ctx.batch_size, 4), torch.randn(1, 3))]


def raising(ctx):
    raise RuntimeError("the bucket is gone")


def number(ctx):
    return 3
'''

STEPS, MICROBATCHES = 3, 3


@pytest.fixture(scope="module")
def user(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A user's model file (an MLP that no zoo holds) compiled into 3 stages."""
    root = tmp_path_factory.mktemp("user")
    (root / "calls").mkdir()
    file = root / "my_model.py"
    file.write_text(MODEL.format(calls=str(root / "calls")))
    ok(fxpipe_cli("compile", f"{file}:build", "--stages", "3", "--out", root / "plan"))
    return {"file": file, "plan": root / "plan", "calls": root / "calls"}


def _run(user: dict[str, Path], *args: Any) -> Any:
    return fxpipe_cli("run", user["plan"], "--steps", STEPS, "--microbatches", MICROBATCHES, *args)


# -- one launch: 3 stages on 3 ranks, the user's model, loss and data ----------------------------------------------


@pytest.fixture(scope="module")
def launched(user: dict[str, Path]) -> dict[str, Any]:
    f = user["file"]
    return json.loads(ok(_run(user, "--loss", f"{f}:loss", "--data", f"{f}:batches", "--json")).stdout)


def test_the_middle_stage_reads_no_data_and_each_end_only_its_part(user: dict[str, Path],
                                                                   launched: dict[str, Any]) -> None:
    calls = {p.stem: json.loads(p.read_text()) for p in user["calls"].iterdir()}
    assert sorted(calls) == ["launcher", "rank0", "rank2"]  # rank 1 runs the middle stage: never called
    assert (calls["rank0"]["needs_inputs"], calls["rank0"]["needs_targets"]) == (True, False)
    assert (calls["rank2"]["needs_inputs"], calls["rank2"]["needs_targets"]) == (False, True)
    assert (calls["launcher"]["needs_inputs"], calls["launcher"]["needs_targets"], calls["launcher"]["rank"]) == \
        (True, True, -1)
    assert calls["rank0"]["batch_size"] == MICROBATCHES * 2 and calls["rank0"]["replicas"] == 1
    assert calls["rank0"]["inputs"] == [["input_1", [MICROBATCHES * 2, 4], "torch.float32"]]


def test_a_user_model_trains_as_one_process_does(user: dict[str, Path], launched: dict[str, Any]) -> None:
    """The same model (built as compile built it), the same batches, plain SGD at fxpipe run's default lr."""
    import importlib.util

    from fxpipe.targets import resolve

    model = resolve(f"{user['file']}:build").model
    spec = importlib.util.spec_from_file_location("user_model_reference", user["file"])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    ctx = data.DataContext(0, True, True, 0, 1, MICROBATCHES, 2, 0, 0, STEPS)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    losses = []
    for k in range(STEPS):
        x, t = module.step_batch(k, ctx)
        loss = sum(module.loss(model(xi), ti) for xi, ti in zip(x.tensor_split(MICROBATCHES),
                                                                 t.tensor_split(MICROBATCHES))) / MICROBATCHES
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    assert launched["ranks"] == 3 and launched["batch"] == MICROBATCHES * 2
    torch.testing.assert_close(launched["losses"], losses, rtol=1e-5, atol=0)


# -- bad specs: one line, before any rank starts -------------------------------------------------------------------


@pytest.mark.parametrize(("args", "message"), [
    ([], "not a built-in model, so fxpipe run has no loss for it; pass --loss FILE.py:FUNCTION"),
    (["--loss", "{dir}/missing.py:loss"], "no such file {dir}/missing.py"),
    (["--loss", "{file}:nope"], "has no callable 'nope' (absent)"),
    (["--loss", "{file}:NOT_A_FUNCTION"], "has no callable 'NOT_A_FUNCTION' (a int)"),
    (["--loss", "no_such_module_anywhere:loss"], "cannot import module 'no_such_module_anywhere'"),
    (["--loss", "loss"], "--loss 'loss' is not FILE.py:FUNCTION"),
    (["--loss", ".relative:loss"], "cannot import module '.relative' (the 'package' argument is required"),
    (["--loss", "{file}:vector_loss"], "returned a tensor of shape [2, 3], not a scalar tensor"),
    (["--loss", "{file}:constant_loss"], "does not depend on the model's outputs"),
    (["--loss", "{file}:raising_loss"], "raising_loss takes no synthetic target (class ids [2] or floats [2, 3]; "
                                        "last: ValueError: no loss here); pass --data FILE.py:FUNCTION"),
    (["--loss", "{file}:raising_loss", "--data", "{file}:batches"], "raised ValueError: no loss here"),
    (["--loss", "{file}:loss", "--data", "{file}:nope"], "--data {file}:nope: {file} has no callable 'nope'"),
    (["--loss", "{file}:loss", "--data", "{file}:wide"],
     "gave input input_1 as [6, 5] float32, and the plan expects [6, 4] float32 (3 microbatches x 2 rows"),
    (["--loss", "{file}:loss", "--data", "{file}:long_inputs"], "as [6, 4] int64, and the plan expects [6, 4] float32"),
    (["--loss", "{file}:loss", "--data", "{file}:short_target"], "gave a target of shape [1, 3], and a batch has 6"),
    (["--loss", "{file}:loss", "--data", "{file}:raising"], "raised RuntimeError: the bucket is gone"),
    (["--loss", "{file}:loss", "--data", "{file}:number"], "returned a int; return a list or an iterable"),
    (["--loss", "{file}:loss", "--data", "text:stdlib"], "gives one int64 input of byte ids"),
])
def test_bad_specs_are_one_line_before_any_rank_starts(user: dict[str, Path], args: list[str], message: str,
                                                       no_rank_starts: list[list[str]]) -> None:
    fill = {"file": user["file"], "dir": user["file"].parent}
    line = one_line_error(_run(user, *[a.format(**fill) for a in args]))
    assert message.format(**fill) in line, line


def test_a_zoo_plan_takes_a_user_loss_and_checks_it(user: dict[str, Path], no_rank_starts: list[list[str]]) -> None:
    from tests._helpers import MLP_PLAN, cli_plan

    line = one_line_error(fxpipe_cli("run", cli_plan(*MLP_PLAN), "--loss", f"{user['file']}:constant_loss"))
    assert "constant_loss returned a scalar that does not depend on the model's outputs" in line, line


def test_a_zoo_plan_checks_its_own_loss_on_a_data_functions_target(user: dict[str, Path], tmp_path: Path,
                                                                  no_rank_starts: list[list[str]]) -> None:
    from tests._helpers import MLP_PLAN, cli_plan

    """mlp-tiny's loss takes class ids; a data function giving float targets (3 per row) is refused."""
    (tmp_path / "zoo_data.py").write_text("import torch\n\n\ndef floats(ctx):\n"
                                          "    return [(torch.randn(ctx.batch_size, 32), "
                                          "torch.randn(ctx.batch_size, 3))]\n")
    line = one_line_error(fxpipe_cli("run", cli_plan(*MLP_PLAN), "--data", f"{tmp_path / 'zoo_data.py'}:floats"))
    assert "mlp-tiny's own loss (no --loss) raised RuntimeError" in line, line
    assert line.endswith("give the targets mlp-tiny's loss takes (fxpipe inspect PLAN shows them), or pass "
                         "--loss"), line


def test_resolve_function() -> None:
    assert resolve_function("json:dumps", "--loss", "x.py:f") is json.dumps
    with pytest.raises(TargetError, match="is not FILE.py:FUNCTION"):
        resolve_function("json", "--data", "my_data.py:batches")
    with pytest.raises(TargetError, match="json has no callable 'decoder'"):
        resolve_function("json:decoder", "--data", "my_data.py:batches")  # a module, not callable


# -- the data layer: jsonl, shards, what a data function returns ---------------------------------------------------


def test_jsonl_reads_lists_and_fields_into_one_token_stream(tmp_path: Path) -> None:
    file = tmp_path / "ids.jsonl"
    lines = [json.dumps(list(range(k, k + 30))) for k in range(0, 300, 30)]
    lines[3] = json.dumps({"input_ids": list(range(90, 120)), "text": "ignored"})
    lines[4] = json.dumps({"tokens": list(range(120, 150))})
    file.write_text("\n".join(lines[:5]) + "\n\n" + "\n".join(lines[5:]) + "\n")
    source = data.parse_data(f"jsonl:{file}")
    assert isinstance(source, data.Text) and source.vocab_size == 300
    assert torch.equal(torch.cat([source.train, source.heldout]), torch.arange(300))
    assert len(source.heldout) == 30
    idx, target = source.batch(0, 4, 8, seed=1)
    assert idx.dtype == torch.int64 and idx.shape == (4, 8) and torch.equal(target, idx + 1)


@pytest.mark.parametrize(("text", "message"), [
    ("[1, 2]\nnot json\n", "line 2 is not JSON"),
    ('{"text": "hi"}\n', "line 1 has no token ids (fields: text); put them under one of input_ids, tokens, ids"),
    ("[1, -2]\n", "line 1 has a negative token id (-2)"),
    ("[1, 2.5]\n", "line 1 is not a list of integer token ids"),
    ("\n\n", "holds no token ids"),
])
def test_jsonl_errors_are_one_line(tmp_path: Path, text: str, message: str) -> None:
    file = tmp_path / "bad.jsonl"
    file.write_text(text)
    with pytest.raises(OptionError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        data.parse_data(f"jsonl:{file}")
    with pytest.raises(OptionError, match="no such file"):
        data.parse_data(f"jsonl:{tmp_path / 'missing.jsonl'}")


def test_jsonl_vocabulary_is_checked_against_the_model(tmp_path: Path) -> None:
    file = tmp_path / "ids.jsonl"
    file.write_text(json.dumps(list(range(500))) + "\n")
    source = data.parse_data(f"jsonl:{file}")
    example = (torch.zeros(2, 8, dtype=torch.int64),)
    with pytest.raises(OptionError,
                       match="has token ids up to 499 .vocabulary 500., but the model's vocabulary is 256"):
        data.check_fit(source, example, (2, 8, 256))
    assert data.check_fit(source, example, (2, 8, 512)).seq_len == 8


def test_a_replica_shard_is_its_slice_of_the_global_batch() -> None:
    text = data.load_stdlib_text(max_bytes=4096)
    idx, target = text.batch(5, 8, 16, seed=3)
    for d in range(4):
        mine = text.batch(5, 8, 16, seed=3, shard=(d, 4))
        assert torch.equal(mine[0], idx[2 * d:2 * d + 2]) and torch.equal(mine[1], target[2 * d:2 * d + 2])
    with pytest.raises(OptionError, match="does not split into 3 equal shards"):
        text.batch(0, 8, 16, shard=(0, 3))
    pytest.importorskip("sklearn")
    digits = data.load_digits()
    x, y = digits.batch(2, 6, seed=1)
    x1, y1 = digits.batch(2, 6, seed=1, shard=(1, 2))
    assert torch.equal(x1, x[3:]) and torch.equal(y1, y[3:])


def test_user_batches_index_a_sequence_and_stream_an_iterable() -> None:
    both = data.DataContext(0, True, True, 0, 1, 2, 1, 0, 0, 3)
    items = [(torch.full((2, 1), float(k)), torch.full((2,), float(k))) for k in range(2)]
    batch = data.user_batches(items, both, "f.py:g")
    assert [float(batch(k)[0][0][0, 0]) for k in (0, 1, 2, 3)] == [0.0, 1.0, 0.0, 1.0]  # a sequence repeats
    first_only = data.DataContext(0, True, False, 0, 1, 2, 1, 0, 1, 3)
    inputs, target = data.user_batches(iter(items), first_only, "f.py:g")(1)  # an iterable starts at ctx.start
    assert target is None and torch.equal(inputs[0], items[0][0])
    stream = data.user_batches(iter(items), both, "f.py:g")
    with pytest.raises(OptionError, match="read in order from step 0, and step 1 was asked"):
        stream(1)
    stream(0), stream(1)
    with pytest.raises(OptionError, match="ran out of batches at step 2"):
        stream(2)
    with pytest.raises(OptionError, match="not a pair"):
        data.user_batches([torch.zeros(2)], both, "f.py:g")(0)


def test_a_rank_that_needs_inputs_or_targets_refuses_none(user: dict[str, Path], tmp_path: Path) -> None:
    """One rank holding every stage needs both; a rank's batch may leave out only what it does not need."""
    from tests.runtime._one_rank import run_one_rank

    stdout = run_one_rank(tmp_path, f"""
        from fxpipe.schedules.generators import interleaved_1f1b

        rt = PipelineRuntime({str(user['plan'])!r}, loss_fn=lambda out, t: out.sum(),
                             schedule=interleaved_1f1b(3, 2, stages_per_rank=3))
        print('needs:', rt.needs_inputs, rt.needs_targets)
        x, t = torch.randn(4, 4), torch.randn(4, 3)
        for inputs, target in ((None, t), (x, None)):
            try:
                rt.step(inputs, target, shard=True)
            except OptionError as exc:
                print('refused:', exc)
        print('loss:', float(rt.step(x, t, shard=True)) > 0)
        """)
    assert "needs: True True" in stdout
    assert "refused: rank 0 runs stages [0, 1, 2], which need the model's inputs, and got None" in stdout
    assert "refused: rank 0 runs stages [0, 1, 2], which need the target, and got None" in stdout
    assert "loss: True" in stdout


BLOCKING = '''
import time

import torch


def batches(ctx):
    if ctx.rank >= {rank}:  # blocks (a FIFO, a lock, a network read that never answers)
        time.sleep(3600)
    return [(torch.randn(ctx.batch_size, 8), torch.randint(0, 4, (ctx.batch_size,)))]


def loss(out, target):
    return torch.nn.functional.cross_entropy(out, target)
'''


def test_a_data_function_that_never_returns_is_stopped_at_the_timeout(tmp_path: Path) -> None:
    """In the launcher's check, one line before any rank starts; in every rank at once (where no collective would
    time out), one line naming a rank: never a hang."""
    import time

    (tmp_path / "model.py").write_text("import torch\n\n\ndef build():\n    return torch.nn.Sequential(torch.nn.Linear("
                                       "8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)), (torch.randn(2, 8),)\n")
    ok(fxpipe_cli("compile", f"{tmp_path / 'model.py'}:build", "--stages", "2", "--out", tmp_path / "plan"))
    for rank, where in ((-1, "(on rank -1; -1: the launcher's check)"), (0, "rank ")):
        (tmp_path / f"block{rank + 1}.py").write_text(BLOCKING.replace("{rank}", str(rank)))
        spec = f"{tmp_path / f'block{rank + 1}.py'}"
        started = time.monotonic()
        line = one_line_error(fxpipe_cli("run", tmp_path / "plan", "--steps", 1, "--timeout", 3, "--data",
                                         f"{spec}:batches", "--loss", f"{spec}:loss"))
        assert "did not return within --timeout 3 s" in line and where in line, line
        assert time.monotonic() - started < 120  # stopped, not left to hang (an hour's sleep)


def test_a_warning_in_a_rank_reaches_the_terminal(tmp_path: Path) -> None:
    """A rank's stderr is torchrun's: what the user's loss (or fxpipe) warns of in a rank is said by fxpipe run, once
    per message with the ranks that raised it."""
    (tmp_path / "model.py").write_text(
        "import warnings\n\nimport torch\n\n\ndef build():\n    return torch.nn.Sequential(torch.nn.Linear(8, 8), "
        "torch.nn.ReLU(), torch.nn.Linear(8, 4)), (torch.randn(2, 8),)\n\n\ndef loss(out, target):\n"
        "    warnings.warn('labels look shuffled')\n    return torch.nn.functional.cross_entropy(out, target)\n")
    ok(fxpipe_cli("compile", f"{tmp_path / 'model.py'}:build", "--stages", "2", "--out", tmp_path / "plan"))
    result = ok(fxpipe_cli("run", tmp_path / "plan", "--steps", 2, "--loss", f"{tmp_path / 'model.py'}:loss",
                           "--json"))
    assert "warning: UserWarning: labels look shuffled (rank 1)" in result.stderr.splitlines(), result.stderr
