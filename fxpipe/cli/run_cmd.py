"""``fxpipe run PLAN_DIR``: train a plan on its schedule's ranks x --dp replicas and compare the measured step
with the simulated one.

On one machine or several: each machine's ``fxpipe run`` starts its ``--nproc`` ranks under torchrun
(``--standalone``, or the nodes meet at ``--master-addr`` / ``--rdzv-endpoint``), the one holding rank 0
prints the results and the others one line about their ranks. Everything that can be checked is
checked before any rank starts. The options are :class:`fxpipe.cli.run_config.RunConfig`; starting the ranks
and naming a failed one is ``fxpipe.cli.ranks``; each rank runs ``fxpipe.cli.rank`` on the same config.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from fxpipe.cli import ranks, run_log
from fxpipe.cli.common import (
    check_outputs,
    check_writable_file,
    err,
    one_line_errors,
    out,
    progress,
    quiet_torch_logs,
    say,
    write_output,
)
from fxpipe.cli.config import CONFIG_FILE, command, write_json
from fxpipe.cli.run_config import RunConfig
from fxpipe.errors import OptionError, RankFailedError

STALL_GRACE_S = 5.0  # past --timeout, when no rank moves on: a rank waiting for a peer says so first
SETUP_S = 300.0  # at least this long for one step of a rank's set-up (a Python importing torch on a loaded machine)
RUN_FILE = "run.json"  # the ranks' configuration, in the run's report directory


@dataclass(frozen=True)
class Checked:
    """What the launcher found before starting any rank: the schedule and what follows from it."""

    plan: Any
    sched: Any
    codegen: str  # --codegen, or eager where Inductor cannot compile here
    recompute_note: str
    replicas: int
    nproc: int
    meeting: Any  # ranks.Rendezvous


def _run(ctx: Any, config: RunConfig) -> None:
    """Train the plan on its schedule's ranks x --dp (torchrun's elastic agent, gloo), on this machine or across
    --nnodes machines: per-step table, measured vs simulated."""
    with one_line_errors():
        environ = dict(os.environ)  # the user's, before Inductor's first use sets its cache folder in it
        quiet_torch_logs()  # torch is imported (config.command did, with the signals held)
        checked = _check_run(config, ctx.meta.get(CONFIG_FILE))
        ckpt = config.checkpoint
        ckpt_lock = _check_checkpoint_dir(ckpt.checkpoint_dir, resume=ckpt.resume, overwrite=ckpt.overwrite,
                                          steps=config.training.steps, lock=config.launch.nnodes == 1)
        try:  # the lock is freed however this ends
            launched = _launch(config, checked, environ)
        finally:
            if ckpt_lock is not None:
                ckpt_lock.close()  # the checkpoint directory's lock
        if launched is not None:
            _report(config, checked, *launched)


run_cmd = command(RunConfig, _run, "run")


def _check_run(config: RunConfig, config_file: Path | None) -> Checked:
    """Everything that can be checked before any rank starts: the plan and the schedule against the options
    (``config_file``: the --config file, which may be the log directory's own config.toml, run again)."""
    from fxpipe.plan_dir import read_plan, read_plan_json
    from fxpipe.schedules.auto import plan_recompute, plan_schedule

    t, c, d, lg, la = config.training, config.compute, config.data, config.logging, config.launch
    text = Path(d.data[len("text:"):]) if d.data.startswith("text:") and d.data != "text:stdlib" else None
    check_outputs([("the plan directory", config.plan_dir), ("the --data file", text)],
                  [("--trace", lg.trace), ("--checkpoint-dir", config.checkpoint.checkpoint_dir),
                   ("--log-dir", lg.log_dir)])
    plan = read_plan(config.plan_dir)
    if t.microbatches is not None:
        from fxpipe.cli.common import check_schedule_size

        check_schedule_size(plan.num_stages, t.microbatches)
    if plan.strategy is not None:  # a synchronous schedule, one stage per rank group (else one line)
        from fxpipe.cli.rank_strategy import strategy_schedule

        sched = strategy_schedule(plan, t.schedule, t.microbatches)
    else:
        sched = plan_schedule(plan, t.schedule, t.microbatches)
    from fxpipe.runtime.codegen import check_codegen

    fallback = check_codegen(c.codegen)
    _check_device(c.device, c.cuda_graphs, plan, sched, c.codegen)  # before the fallback's warning: one line
    # the stages that recompute (auto: under the plan's cap), checked here; the ranks decide the same
    recomputed, recompute_note = plan_recompute(plan, sched, t.recompute)
    shared = read_plan_json(config.plan_dir)["shared_params"]
    _check_pipeline_options(config, plan, sched, bool(recomputed), shared)
    codegen = c.codegen
    if fallback is not None:
        say(f"warning: {fallback}")
        codegen = "eager"
    from fxpipe.runtime.optim import autocast_of

    autocast_of(c.precision, c.device)
    config.host_tuning()  # a wrong value is refused here, before any rank starts
    replicas = la.dp if la.dp is not None else plan.mesh.dp
    _check_sizes(replicas, la.nproc, la.nnodes, t.seed, sched.num_ranks)
    if t.w_lane:
        _check_w_lane(config, plan, sched, replicas, shared)
    meeting = _rendezvous(la.nnodes, la.node_rank, la.master_addr, la.master_port, la.rdzv_endpoint, la.rdzv_id,
                          la.rdzv_timeout)
    nproc = _ranks_per_node(sched, replicas, la.nproc, la.nnodes)
    if lg.trace is not None:
        from fxpipe.schedules.timeline import is_fxpipe_trace

        check_writable_file(lg.trace, "--trace", is_fxpipe_trace)  # before training: a failed write would lose it
    if lg.log_dir is not None:
        run_log.check_log_dir(lg.log_dir, continuing=config.checkpoint.resume != "never",
                              rerun=run_log.is_own_config(config_file, lg.log_dir))
    return Checked(plan, sched, codegen, recompute_note, replicas, nproc, meeting)


def _check_pipeline_options(config: RunConfig, plan: Any, sched: Any, recomputed: bool,
                            shared: dict[str, Any]) -> None:
    """The schedule's kind (synchronous or not) and the plan's (pipeline or per-layer strategy) against the
    options: each refusal is one line."""
    t, o, c = config.training, config.optimizer, config.compute
    if recomputed and plan.strategy is not None:
        raise OptionError(f"--recompute {t.recompute} recomputes pipeline stages; this plan is a per-layer strategy "
                          "(DTensor layers): use --recompute none")
    if plan.strategy is not None and c.precision != "fp32":
        raise OptionError(f"--precision {c.precision} autocasts pipeline stages' graphs; a per-layer strategy plan "
                          "trains its DTensor layers in fp32: use --precision fp32")
    if sched.synchronous:
        return
    if recomputed:
        raise OptionError(f"--recompute {t.recompute}: {sched.name} is asynchronous, and its phases read weight "
                          "versions a recomputed forward would not see; use --recompute none, or a synchronous "
                          "schedule")
    if c.codegen != "eager":
        raise OptionError(f"--codegen {c.codegen} compiles synchronous schedules' stages; {sched.name} reads weight "
                          "versions through functional_call: use --codegen eager")
    if shared:
        name = sorted(shared)[0]
        raise OptionError(f"{name} is shared by stages {shared[name]}; an asynchronous schedule steps each "
                          "stage on its own, which would update a tied weight from part of its gradient: "
                          "train this plan with a synchronous schedule (e.g. --schedule 1f1b)")
    if t.weights.startswith("predict") and o.momentum == 0:
        raise OptionError(f"--weights {t.weights} extrapolates with SGD's momentum, and --momentum is 0; "
                          "pass --momentum 0.9 (or --weights stash)")
    if (o.clip_grad_norm is not None or c.precision == "fp16" or o.lr_schedule != "constant" or o.warmup_steps
            or o.skip_nonfinite):
        raise OptionError(f"{sched.name} steps each stage after every microbatch, with no step of the whole model "
                          "to clip, unscale, skip or schedule at: use a synchronous schedule (e.g. --schedule 1f1b) "
                          "for --clip-grad-norm, --precision fp16, --skip-nonfinite or --lr-schedule")


def _check_w_lane(config: RunConfig, plan: Any, sched: Any, replicas: int, shared: dict[str, Any]) -> None:
    """What the ranks would refuse of --w-lane, refused before any starts (``shared``: the plan's tied weights)."""
    from fxpipe.runtime.lane import refusal

    tied = any(len({sched.rank_of_stage[k] for k in holders}) > 1 for holders in shared.values())
    why = "--w-lane runs pipeline plans' W's; a per-layer strategy has none" if plan.strategy is not None \
        else refusal(synchronous=sched.synchronous, dp=replicas, tied=tied,
                     global_norm=config.optimizer.clip_grad_norm is not None or config.compute.precision == "fp16"
                     or config.optimizer.skip_nonfinite,
                     device=config.compute.device, batched=sched.batch_w)
    if why is not None:
        raise OptionError(why)


def _check_data(config: RunConfig, checked: Checked) -> tuple[Any, dict[str, Any]]:
    """--data, --loss and --eval-data resolved, a first batch and the loss checked against the plan
    (``fxpipe.cli.feed``): the held-out score's source and fit, and what the ranks get besides the config."""
    from fxpipe.cli.feed import RunShape, check_feed, trusted_ops
    from fxpipe.cli.rank import zoo_of
    from fxpipe.data import load_hf

    d, t, plan = config.data, config.training, checked.plan
    zoo = zoo_of(plan, device="meta")  # the built-in model the plan names, if any: no memory
    trusted = trusted_ops(t.trust_ops)
    if zoo is not None:  # a size the graphs compute, before anything runs them (check_feed runs a user
        from fxpipe.plan_dir import check_allocations  # model's plan on meta under the same check)

        check_allocations(config.plan_dir, trust_ops=trusted)
    hf = load_hf(d.data[len("hf:"):], tokenizer=d.tokenizer, column=d.data_column) if d.data.startswith("hf:") \
        else None  # tokenized once, here; the ranks read its ids
    feed = check_feed(config.plan_dir, plan, zoo, d.data if hf is None else hf, t.loss,
                      RunShape(checked.sched.num_microbatches, checked.replicas, t.seed, t.steps), trust_ops=trusted,
                      timeout=config.launch.timeout)
    eval_hf = _check_eval(plan, checked.sched, d.eval_data, d.eval_every, d.eval_batches, checked.replicas, d.data,
                          hf, d.tokenizer, d.data_column)
    _check_model(config.plan_dir, plan, zoo)  # before any rank builds the model the plan names
    extra = {"trust_ops": list(trusted), "synthetic": feed.synthetic, "hf": hf, "eval_hf": eval_hf}
    return feed, extra


def _launch(config: RunConfig, checked: Checked, environ: dict[str, str]) -> tuple[Any, Any] | None:
    """Start the ranks and follow them to the end: their results and the held-out score (None: this node's ranks
    are done and another node prints the results)."""
    import tempfile

    feed, extra = _check_data(config, checked)
    la, sched = config.launch, checked.sched
    out_dir: Path | None = None
    try:  # from the report directory's creation on, a signal at any moment removes it
        out_dir = Path(tempfile.mkdtemp(prefix="fxpipe-run-"))
        resolved = config.replace(
            nproc=checked.nproc, dp=checked.replicas, codegen=checked.codegen,
            microbatches=sched.num_microbatches,
            schedule=config.training.schedule if config.training.schedule is not None or checked.plan.strategy
            is not None else sched.name)
        _write_log_config(config, resolved)
        hf, eval_hf = extra.pop("hf"), extra.pop("eval_hf")
        rank_data = {"data": config.data.data if hf is None else f"jsonl:{write_ids(hf, out_dir / 'tokens.jsonl')}",
                     "eval_data": config.data.eval_data if eval_hf is None else
                     f"jsonl:{write_ids(eval_hf, out_dir / 'eval_tokens.jsonl')}"}
        run_file = write_json(config.replace(codegen=checked.codegen, **rank_data), out_dir / RUN_FILE, **extra)
        from fxpipe.runtime.codegen import cache_env

        with progress(disable=config.logging.as_json) as step:
            steps = config.training.steps
            step(f"starting {checked.nproc} ranks" + (f" (node {la.node_rank} of {la.nnodes}: waiting for the others "
                                                      f"at {checked.meeting.where()})" if la.nnodes > 1 else ""),
                 0, steps)
            rank_env = {**ranks.restart_env(la.max_restarts),
                        **(cache_env(environ) if checked.codegen == "inductor" else {})}
            proc = ranks.run_ranks(ranks.torchrun_command([run_file, "--out", out_dir], checked.nproc,
                                                          rendezvous=checked.meeting, max_restarts=la.max_restarts),
                                   out_dir / "progress",
                                   lambda s: step(f"step {s.step}/{steps}: loss {s.loss:.6f}, {s.ms:.1f} ms",
                                                  s.step, steps), env=rank_env,
                                   # every rank busy: stopped a few seconds after a waiting rank would give up
                                   stall_s=la.timeout + STALL_GRACE_S,
                                   first_s=max(la.timeout, SETUP_S) + STALL_GRACE_S
                                   + (la.rdzv_timeout if la.nnodes > 1 else 0))
        results = _results(config, checked, proc, out_dir)
        if results is None:
            return None
        heldout = _held_out(config.plan_dir, out_dir, feed.source, feed.fit, tuple(extra["trust_ops"])) \
            if feed.fit is not None else None
        return results, heldout
    finally:
        if out_dir is not None:
            _remove(out_dir)


def _remove(out_dir: Path, tries: int = 20) -> None:
    """The run's report directory, removed: again for a moment if a rank that was only starting when the run was
    stopped (torchrun had not shown it yet) wrote its first file there meanwhile."""
    import shutil
    import time

    for _ in range(tries):
        shutil.rmtree(out_dir, ignore_errors=True)
        if not out_dir.exists():
            return
        time.sleep(0.1)


def _write_log_config(config: RunConfig, resolved: RunConfig) -> None:
    """--log-dir's config.toml: every option's final value, before the ranks start (a killed run keeps it), paths
    made absolute so that it runs from any directory."""
    log_dir = config.logging.log_dir
    if log_dir is None:
        return
    absolute = {k: Path(os.path.abspath(v)) if isinstance(v, Path) else v for k, v in resolved.flat().items()}
    absolute.update(data=run_log.absolute_spec(resolved.data.data), loss=run_log.absolute_spec(resolved.training.loss))
    text = RunConfig.from_flat(absolute).to_toml("fxpipe run --config FILE runs it again")
    write_output(log_dir, "--log-dir", lambda d: run_log.write_config(d, text))
    if run_log.tensorboard_missing():
        say("note: tensorboard is not installed, so --log-dir gets no TensorBoard events (pip install -c "
            "constraints.txt -e '.[tensorboard]'); metrics.jsonl and config.toml are written")


def _results(config: RunConfig, checked: Checked, proc: Any, out_dir: Path) -> list[dict[str, Any]] | None:
    """The ranks' results, or the one line that names the rank to look at (RankFailedError)."""
    la = config.launch
    failure = (ranks.stall_failure(proc.stalled, la.timeout, STALL_GRACE_S) if proc.stalled is not None else
               ranks.diagnose(proc.returncode, proc.stderr, ranks.rank_errors(out_dir), ranks.finished_ranks(out_dir),
                              proc.stopped, rendezvous=checked.meeting, local=proc.local))
    results = ranks.rank_results(out_dir)
    restarted = ranks.restarts(out_dir, results)  # --max-restarts: said even when the last attempt failed
    if restarted is not None:
        say(f"note: {restarted}")
    for line in ranks.rank_warnings(out_dir):  # what the ranks warned of reaches the terminal, once each
        say(f"warning: {line}")
    if failure is not None and failure.after_results:  # gloo's teardown, not the training: keep the results
        say(f"warning: {failure.message}")
    elif failure is not None:
        raise RankFailedError(failure.message)
    if results is None and checked.meeting.standalone:
        raise RankFailedError("the ranks finished, but rank 0 wrote no results (its gather of every rank's "
                              "result did not complete); re-run")
    if results is None:  # another node holds rank 0 and prints the run's results
        mine = sorted(ranks.finished_ranks(out_dir))
        _node_done(mine, checked.nproc * la.nnodes, la.node_rank if la.rdzv_endpoint is None else None,
                   config.training.steps, config.logging.as_json)
    return results


def _report(config: RunConfig, checked: Checked, results: list[dict[str, Any]], heldout: Any) -> None:
    """The run's tables (or its JSON object), then --trace."""
    doc = run_doc(config, checked, results, heldout)
    trace = config.logging.trace

    def write_trace() -> None:  # after the results are printed: a failed write cannot lose them
        if trace is not None:
            from fxpipe.schedules.timeline import measured_result, write_chrome_trace

            write_output(trace, "--trace", lambda path: write_chrome_trace(
                measured_result(_on_one_clock(results), f"measured {results[0]['schedule']}"), path))

    if config.logging.as_json:
        print(json.dumps(doc))
        write_trace()
        return
    from fxpipe.render import print_reports

    print_reports(_reports(config, doc, results, heldout, checked.recompute_note), plain=config.logging.plain,
                  console=out)
    write_trace()
    if trace is not None:
        say(f"wrote {trace}")


def run_doc(config: RunConfig, checked: Checked, results: list[dict[str, Any]], heldout: Any) -> dict[str, Any]:
    """The run's JSON object (``fxpipe.run/v1``) from every rank's result."""
    import statistics

    world = len(results)
    first = results[0]
    mesh = {"dims": ["pp", "dp"], "shape": [first.get("pp", world), first.get("dp", 1)],
            "ranks": [[r["rank"] for r in results if r.get("pp_rank", r["rank"]) == p]
                      for p in range(first.get("pp", world))]}
    step_ms = [max(r["step_ms"][i] for r in results) for i in range(len(first["step_ms"]))]
    batch = first["batch"]
    measured = statistics.median(step_ms[1:] if len(step_ms) > 1 else step_ms)
    graph_calls = _graph_calls(results)
    return {
        "schema": "fxpipe.run/v1", "schedule": first["schedule"], "microbatches": first["microbatches"],
        "ranks": world, "dp": mesh["shape"][1], "mesh": mesh, "nodes": config.launch.nnodes, "batch": batch,
        "losses": first["losses"], "step_ms": step_ms, "first_step": first.get("first_step", 0),
        "restarts": first.get("restarts", 0),
        # per step: the learning rate it used, and the global gradient norm before clipping (None without
        # --clip-grad-norm or fp16)
        "lrs": first.get("lrs", []), "grad_norms": first.get("grad_norms", []),
        "eval_losses": first.get("eval_losses", []),
        "step_ms_median": measured, "samples_per_s": batch / (measured / 1e3),
        "simulated_step_ms": first["simulated_step_ms"], "simulated_from_profile": bool(first.get("profiled")),
        # the same simulation on the actions' measured times: the schedule model's part of the gap
        "replayed_step_ms": first.get("replayed_step_ms"),
        "simulated_without_runtime_costs": bool(first.get("runtime_costs_missing")),
        "calibration": first.get("calibration"),  # the link and contention the simulation charged
        "peak_rss_mib_per_rank": [r["peak_rss_mib"] for r in results],
        # each rank's CPUs (--pin-ranks; empty: placed by the system)
        "cpus_per_rank": [r.get("cpus", []) for r in results],
        "device": config.compute.device, "cuda_graphs": graph_calls is not None, "cuda_graph_calls": graph_calls,
        # what carried the messages: nccl where each rank had a GPU of its own, else gloo (fxpipe.cli.rank)
        "backend": ", ".join(sorted({str(r.get("backend", "gloo")) for r in results})),
        "synchronous": first.get("synchronous", True), "weights": None if first.get(
            "synchronous", True) else first.get("weights"), "data": config.data.data, "held_out": heldout,
        "recompute": first.get("recompute", []), "recompute_note": checked.recompute_note,
        **_held_per_stage(results),
        # batched-w: how each stage's W ran (one call over the microbatches, or per microbatch and why)
        "batched_w": {s: how for r in results for s, how in r.get("batched_w", {}).items()} or None,
        # per stage and kind of action, ms per microbatch: measured (median over the steps after the first,
        # the slowest replica's) and as the simulation charged it
        "actions": _actions(results),
    }


def _step_note(doc: dict[str, Any], results: list[dict[str, Any]], nnodes: int) -> tuple[str, ...]:
    """The notes under the per-step table: what ran, and what the simulation charged."""
    world, first, mesh, batch = len(results), results[0], doc["mesh"], doc["batch"]
    measured = doc["step_ms_median"]
    ran = ((f"{doc['schedule']} asynchronous (--weights {doc['weights']}): every microbatch is an update of each "
            "stage and the steps stream through one schedule, so each step's time is the run's mean; "
            if not doc["synchronous"] else "")
           + (f"per-layer {doc['schedule']} on {world} ranks (each layer takes its share of the {batch}-row batch)"
              if doc["schedule"].startswith("strategy ") else
              f"{doc['schedule']}, {doc['microbatches']} microbatches, {world} ranks"
              + (f" on CUDA ({_gpus(results)})" if doc["device"] == "cuda" else "")
              + (", stages replayed as CUDA graphs" if doc["cuda_graphs"] else "")
              + (f" ({mesh['shape'][0]} pipeline ranks x {mesh['shape'][1]} replicas, each replica "
                 f"{doc['microbatches']} microbatches of the {batch}-row batch)" if mesh["shape"][1] > 1 else ""))
           + (f" on {nnodes} nodes" if nnodes > 1 else "") + ": median step "
           f"{measured:.2f} ms measured (after the first), {doc['simulated_step_ms']:.2f} ms simulated"
           + ("" if first.get("profiled") else
              " from estimated costs (compile with --profile to simulate with measured ones)")
           + (f" (profiled with {first['profile_threads']} threads, the ranks ran with 1: compile with "
              "--profile-threads 1 to match)" if (first.get("profile_threads") or 1) != 1 else ""))
    return ((ran,)
            + ((f"simulated on the ranks' calibration after the steps: {doc['calibration']['summary']}",)
               if doc["calibration"] else ())
            + ((f"replayed: {doc['replayed_step_ms']:.2f} ms, the schedule simulated on the actions' measured times "
                "(the table below): the gap to the measured step that the schedule model leaves; the rest of the "
                "simulation's is the per-action costs'",)
               if doc["replayed_step_ms"] is not None and doc["actions"] else ())
            + ((RUNTIME_COSTS_MISSING,) if doc["simulated_without_runtime_costs"] else ())
            + tuple(f"stage {s}'s W: {how}" for s, how in sorted((doc["batched_w"] or {}).items(),
                                                                 key=lambda kv: int(kv[0]))))


def _reports(config: RunConfig, doc: dict[str, Any], results: list[dict[str, Any]], heldout: Any,
             recompute_note: str) -> list[Any]:
    """The run's tables: per step, per rank, per action, memory per stage, the held-out score."""
    import statistics

    from fxpipe.report import Report

    mesh = doc["mesh"]
    per_step = Report("run: per step", *step_rows(doc, doc["step_ms"], doc["batch"], doc["first_step"]),
                      _step_note(doc, results, config.launch.nnodes))
    per_rank = Report("run: per rank", ("rank", "pp", "dp", "stages", "host", "CPUs", "peak RSS MiB",
                                        "median step ms"),
                      tuple((r["rank"], r.get("pp_rank", r["rank"]), r.get("dp_rank", 0),
                             ",".join(map(str, r.get("stages", []))), r.get("host", ""),
                             ",".join(map(str, r.get("cpus", []))) or "any",
                             round(r["peak_rss_mib"], 1), round(statistics.median(r["step_ms"]), 2))
                            for r in results),
                      (f"mesh (pp, dp) = ({mesh['shape'][0]}, {mesh['shape'][1]}): rank = pp x {mesh['shape'][1]} "
                       + ("+ dp, so a stage's ranks are neighbours; each layer's parameters and gradients are "
                          "split or replicated over them as the plan's per-layer strategy says"
                          if doc["schedule"].startswith("strategy ") else
                          "+ dp, so a stage's replicas are neighbouring ranks; gradients are averaged over each "
                          "stage's replicas"),) if mesh["shape"][1] > 1 else ())
    reports = [per_step, per_rank]
    if doc["actions"]:
        reports.append(_actions_report(doc))
    if doc.get("peak_held_bytes_per_stage"):
        reports.append(_held_report(doc, results, recompute_note))
    if heldout is not None:
        reports.append(Report("run: held out", tuple(heldout), (tuple(heldout.values()),),
                              (f"{config.data.data} held-out split, after the last step, with every rank's weights",)))
    return reports


RUNTIME_COSTS_MISSING = ("simulated without the runtime's fixed costs per action, message and step: this machine has "
                         "none cached for the calibration the plan was estimated with (another machine, thread count "
                         "or fxpipe calibration version); run fxpipe compile here again to simulate with them")


def _check_device(device: str, cuda_graphs: bool | None, plan: Any, sched: Any, codegen: str) -> None:
    """--device and --cuda-graphs against the plan, the schedule and --codegen, before any rank starts."""
    if device not in ("cpu", "cuda"):
        raise OptionError(f"--device {device!r} is not a device fxpipe run trains on; use cpu or cuda")
    if cuda_graphs and device != "cuda":
        raise OptionError("--cuda-graphs replays the stages as CUDA graphs, and the ranks train on the CPU; pass "
                          "--device cuda with it, or leave --cuda-graphs off")
    if device == "cuda" and plan.strategy is not None:
        raise OptionError(f"--device cuda runs pipeline plans; this plan's per-layer strategy ({plan.strategy.name}) "
                          "trains on the CPU (DTensor over gloo): use --device cpu")
    if cuda_graphs and not sched.synchronous:
        raise OptionError(f"--cuda-graphs replays synchronous schedules' stages; {sched.name} reads weight versions "
                          "that change between calls: use a synchronous schedule (e.g. --schedule 1f1b) or leave "
                          "--cuda-graphs off")
    if cuda_graphs and codegen != "eager":
        raise OptionError(f"--cuda-graphs replays the eager stage graphs; with --codegen {codegen} Inductor recompiles "
                          "inside the capture and it fails: use --codegen eager, or leave --cuda-graphs off")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise OptionError(f"this machine has no CUDA device torch can use (torch {torch.__version__}); use "
                              "--device cpu")


def _gpus(results: list[dict[str, Any]]) -> str:
    """The devices the ranks trained on (each rank reports its own), e.g. 'cuda:0' or 'cuda:0, cuda:1'."""
    return ", ".join(sorted({str(r.get("device", "cuda")) for r in results}))


def _graph_calls(results: list[dict[str, Any]]) -> dict[str, int] | None:
    """CUDA graphs: the call slots every rank captured, and the calls that ran eagerly after all; else None."""
    calls = [r["graph_calls"] for r in results if r.get("graph_calls")]
    if not calls:
        return None
    return {"captured": sum(c["captured"] for c in calls), "fallbacks": sum(c["fallbacks"] for c in calls)}


def _on_one_clock(results: list[dict[str, Any]]) -> dict[int, list[Any]]:
    """Each rank's last-step events, in seconds from the earliest rank's step start when every rank ran on one
    machine (their ``perf_counter`` is the machine's monotonic clock, so a gap between ranks is a real wait);
    across machines each rank's own step start, which the clocks of two machines cannot relate."""
    # a per-layer strategy run times no events and has no step start
    if len({r["host"] for r in results}) != 1 or any("step_started" not in r for r in results):
        return {r["rank"]: r["events"] for r in results}
    first = min(r["step_started"] for r in results)
    return {r["rank"]: [(a, t0 + r["step_started"] - first, t1 + r["step_started"] - first)
                        for a, t0, t1 in r["events"]] for r in results}


def _actions(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each stage's kinds of action, ms per microbatch, measured and simulated (of a stage's replicas, the slowest
    measured); [] when the ranks did not time them (an asynchronous or per-layer run)."""
    from fxpipe.cli.rank import slowest_actions

    best = slowest_actions(r.get("action_ms", []) for r in results)
    return [{"stage": s, "action": k, "measured_ms": m, "simulated_ms": sim}
            for (s, k), (m, sim) in sorted(best.items())]


def _actions_report(doc: dict[str, Any]) -> Any:
    from fxpipe.report import Report

    rows = tuple((a["stage"], a["action"], round(a["measured_ms"], 3), round(a["simulated_ms"], 3),
                  round(a["measured_ms"] / a["simulated_ms"], 2) if a["simulated_ms"] > 0 else "")
                 for a in doc["actions"])
    return Report("run: each stage's actions, measured and simulated", ("stage", "action", "measured ms",
                                                                       "simulated ms", "measured / simulated"), rows,
                  ("ms per microbatch: measured, the median over the steps after the first of each step's mean (a "
                   "batched run of Ws shared over its microbatches; a stage's optimizer step left out); simulated, "
                   "what the run's simulation charged it (the plan's costs with this run's calibrated contention and "
                   "fixed costs); where they differ is where the plan's estimate is off",))


def _held_per_stage(results: list[dict[str, Any]]) -> dict[str, list[int]]:
    """Per stage (index = stage), the peak bytes it kept between actions, measured and simulated: the largest
    over its replicas; {} when the ranks did not report them (a per-layer strategy)."""
    if not all("peak_held_bytes_per_stage" in r for r in results):
        return {}
    measured: dict[int, int] = {}
    simulated: dict[int, int] = {}
    for r in results:
        for s, got, sim in zip(r["stages"], r["peak_held_bytes_per_stage"], r["simulated_held_bytes_per_stage"]):
            measured[s] = max(measured.get(s, 0), int(got))
            simulated[s] = max(simulated.get(s, 0), int(sim))
    stages = sorted(measured)
    return {"peak_held_bytes_per_stage": [measured[s] for s in stages],
            "simulated_held_bytes_per_stage": [simulated[s] for s in stages]}


def _held_report(doc: dict[str, Any], results: list[dict[str, Any]], recompute_note: str) -> Any:
    from fxpipe.report import Report

    rank_of = {s: r.get("pp_rank", r["rank"]) for r in results for s in r.get("stages", [])}
    rows = tuple((s, rank_of.get(s, ""), round(got / 2**20, 4), round(sim / 2**20, 4),
                  round(got / sim, 3) if sim else "")
                 for s, (got, sim) in enumerate(zip(doc["peak_held_bytes_per_stage"],
                                                    doc["simulated_held_bytes_per_stage"])))
    return Report("run: memory per stage", ("stage", "pp", "held MiB measured", "held MiB simulated",
                                             "measured / simulated"), rows,
                  ("held: the bytes a stage keeps between actions for later ones of the same microbatch (F's saved "
                   "tensors until B, what W reads until W), each storage once, parameters not counted; the peak "
                   "in the run's first step, measured in the runtime and as the schedule's simulation holds the "
                   "plan's F->B and B->W bytes", recompute_note))


def _check_sizes(dp: int, nproc: int | None, nnodes: int, seed: int, pp: int) -> None:
    """The run's counts within ``LIMITS`` before torchrun starts (each rank is a process: --dp 1000000 would spend
    minutes and gigabytes setting up before any failed)."""
    from fxpipe.plan import LIMITS
    from fxpipe.targets import SEED_LEAST, SEED_MOST

    why = "each rank is a process of its own, started before any can fail"
    LIMITS.whole("--dp", dp, LIMITS.ranks, why)
    LIMITS.grid(f"the schedule's {pp} ranks", pp, dp, "lower --dp")
    LIMITS.whole("--nnodes", nnodes, LIMITS.ranks, why)
    if nproc is not None:
        LIMITS.whole("--nproc", nproc, LIMITS.ranks, why)
    LIMITS.whole("--seed", seed, SEED_MOST, "the data's order is drawn from a 64-bit seed", least=SEED_LEAST)


def _check_model(plan_dir: Path, plan: Any, zoo: Any) -> None:
    """The built-in model the plan names (``zoo``, built on the meta device: no memory) must have the parameters
    its stage files hold (names, shapes, count): every rank builds that model, and a plan.json naming gpt-1.5b over
    tiny stages would have each build 1.5 B parameters first."""
    import math

    from fxpipe.errors import PlanFileError
    from fxpipe.plan_dir import read_plan_json

    if zoo is None:
        return  # not a built-in model: the ranks refuse it in one line before building anything
    stored = {p["name"]: tuple(p["shape"]) for s in read_plan_json(plan_dir)["stages"] for p in s["parameters"]}
    # A tied weight (GPT's embedding and LM head) has several names; a stage may hold it under any of them.
    built = {n: tuple(p.shape) for n, p in zoo.model.named_parameters(remove_duplicate=False)}
    name = plan.provenance.model
    wrong = sorted(n for n in stored if built.get(n) != stored[n])
    count = sum(math.prod(v) for v in stored.values())
    total = sum(math.prod(tuple(p.shape)) for p in zoo.model.parameters())  # each tied weight once
    most = sum(math.prod(v) for v in built.values())  # each of its names
    if wrong or not total <= count <= most:
        what = (f"{wrong[0]!r} {list(stored[wrong[0]])} is not a parameter of {name} "
                f"({list(built[wrong[0]]) if wrong[0] in built else 'absent'})" if wrong else
                f"the stage files hold {count:,} parameters and {name} has {total:,}")
        raise PlanFileError(f"{plan_dir} is not a plan of {name}, the model it names: {what}; re-run fxpipe compile")


def _rendezvous(nnodes: int, node_rank: int, master_addr: str | None, master_port: int | None,
                endpoint: str | None, run_id: str, timeout: float) -> ranks.Rendezvous:
    """Where this node meets the others, checked before any rank starts."""
    if master_addr is not None and endpoint is not None:
        raise OptionError("--master-addr (static rendezvous) and --rdzv-endpoint (c10d) both say where the nodes "
                          "meet; pass one of them")
    if master_port is not None and master_addr is None:
        raise OptionError("--master-port needs --master-addr (node 0's address); with --rdzv-endpoint, put the port "
                          "in it (HOST:PORT)")
    if nnodes > 1 and master_addr is None and endpoint is None:
        raise OptionError(f"--nnodes {nnodes} needs where the nodes meet: --master-addr HOST (node 0's address) "
                          "[--master-port PORT], or --rdzv-endpoint HOST:PORT, the same on every node")
    if node_rank >= nnodes:
        raise OptionError(f"--node-rank {node_rank} is not a node of --nnodes {nnodes}; number the nodes 0 to "
                          f"{nnodes - 1}")
    if not master_addr and master_addr is not None:
        raise OptionError("--master-addr is empty; give node 0's host name or address")
    if endpoint is not None:
        host, _, port = endpoint.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise OptionError(f"--rdzv-endpoint {endpoint!r} is not HOST:PORT; write e.g. node0.example:29400")
    return ranks.Rendezvous(nnodes, node_rank, master_addr, master_port, endpoint, run_id, timeout)


def _ranks_per_node(sched: object, dp: int, nproc: int | None, nnodes: int) -> int:
    """--nproc (ranks on this node), checked against the schedule's ranks x dp over --nnodes nodes; its default."""
    pp, name, stages = sched.num_ranks, sched.name, sched.num_stages  # type: ignore[attr-defined]
    if dp > 1 and not sched.synchronous:  # type: ignore[attr-defined]
        raise OptionError(f"{name} is asynchronous, and asynchronous training runs one replica per stage (--dp {dp}); "
                          "pass --dp 1, or a synchronous schedule (e.g. --schedule 1f1b)")
    world = pp * dp
    per = f"{pp} rank{'s' * (pp != 1)}" + (f" x {dp} replicas = {world} ranks" if dp > 1 else "")
    if nproc is None:
        if world % nnodes:
            raise OptionError(f"{name} runs this plan's {stages} stages on {per}, which do not split evenly over "
                              f"--nnodes {nnodes}; pass --nproc for each node (they must add up to {world}), or "
                              "another --dp")
        return world // nnodes
    if nproc * nnodes != world:
        started = f"{nproc}" if nnodes == 1 else f"--nproc {nproc} x --nnodes {nnodes} = {nproc * nnodes}"
        fix = f"use --nproc {world // nnodes}" if world % nnodes == 0 else f"start {world} ranks over the nodes"
        if (nproc * nnodes) % pp == 0 and sched.synchronous:  # type: ignore[attr-defined]
            fix += f", or --dp {nproc * nnodes // pp}"
        raise OptionError(f"{name} runs this plan's {stages} stages on {per}, not {started}; {fix}")
    return nproc


def _node_done(mine: list[int], world: int, node_rank: int | None, steps: int, as_json: bool) -> None:
    """A node that does not hold rank 0: one line about its ranks (the node holding rank 0 prints the results).
    ``node_rank`` is None under c10d rendezvous, where it does not say which ranks a node runs."""
    if as_json:
        print(json.dumps({"schema": "fxpipe.run.node/v1", "node_rank": node_rank, "ranks": mine, "world": world,
                          "results": "printed by the node that holds rank 0"}))
        return
    who = "this node" if node_rank is None else f"node {node_rank}"
    say(f"{who}: ranks {_spans(mine)} of {world} finished {steps} steps; the node that holds rank 0 prints the "
        "results", console=out)


def _spans(numbers: list[int]) -> str:
    """[2, 3, 5] -> '2-3, 5'."""
    runs: list[list[int]] = []
    for n in numbers:
        if runs and runs[-1][1] == n - 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _check_checkpoint_dir(directory: Path | None, *, resume: str, overwrite: bool, steps: int,
                          lock: bool = True) -> Any:
    """Before any rank starts: a checkpoint directory is resumed from (``resume`` always, or auto when it holds a
    complete checkpoint), overwritten or new, as the options say.

    With ``lock`` (one machine: the nodes of a run across machines share the directory), returns its
    lock (an open file; closing it lets another run in), held for the whole run; else None.
    """
    if directory is None:
        if resume != "never" or overwrite:
            raise OptionError(f"--{f'resume {resume}' if resume != 'never' else 'overwrite'} needs --checkpoint-dir")
        return None
    from fxpipe.runtime import checkpoint

    if resume != "never" and overwrite:
        raise OptionError(f"--resume {resume} continues from the checkpoints that --overwrite would remove; pass one "
                          "of them")
    if directory.exists() and not directory.is_dir():
        raise OptionError(f"--checkpoint-dir {directory} is a file; name a directory")
    if directory.is_symlink():
        raise OptionError(f"--checkpoint-dir {directory} is a symbolic link; give the directory it points to")
    if resume == "always" and not directory.exists():
        checkpoint.newest(directory)  # refuses: nothing to resume (before the lock would make the directory)
    held = checkpoint.lock(directory) if lock else None
    try:
        _check_checkpoints(checkpoint, directory, resume=resume, overwrite=overwrite, steps=steps)
    except BaseException:
        if held is not None:
            held.close()
        raise
    return held


def _check_checkpoints(checkpoint: Any, directory: Path, *, resume: str, overwrite: bool, steps: int) -> None:
    held = sorted(p.name for p in directory.iterdir() if p.name != checkpoint.LOCK_FILE)
    if resume == "auto" and checkpoint.scan(directory).found is None:
        return  # nothing complete to resume: a fresh start (a step it saves replaces a leftover of the same number)
    if resume != "never":
        found, skipped = checkpoint.newest(directory)
        if found.step >= steps:
            raise OptionError(f"the newest checkpoint in {directory} is of step {found.step}, and --steps {steps} "
                              f"(counted from the start of training) asks for no more; pass --steps {found.step + 1} "
                              "or more to train further")
        for line in skipped:
            err.print(f"note: {line}; resuming from {found.path.name}", markup=False, highlight=False, soft_wrap=True)
    elif overwrite:
        checkpoint.clear(directory)
    elif held:
        raise OptionError(f"--checkpoint-dir {directory} is not empty (it holds {', '.join(held[:3])}"
                          f"{', ...' if len(held) > 3 else ''}); pass --resume always (or auto) to continue from its "
                          "newest checkpoint, --overwrite to replace its checkpoints, or another --checkpoint-dir")


def _check_eval(plan: Any, sched: Any, eval_data: str | None, eval_every: int, eval_batches: int, replicas: int,
                data_spec: str, hf: Any, tokenizer: Path | None, column: str) -> Any:
    """``--eval-every``'s data, checked before any rank starts: a synchronous schedule, and held-out data with at
    least one whole batch. Returns an ``hf:`` eval set the launcher tokenized (the ranks read its ids), else None."""
    if not eval_every:
        return None
    from fxpipe import data as data_mod
    from fxpipe.cli.feed import _example_zeros

    if not sched.synchronous:
        raise OptionError(f"--eval-every evaluates between steps, and {sched.name} streams its steps with no "
                          "boundary; use a synchronous schedule (e.g. --schedule 1f1b)")
    spec = eval_data or data_spec
    loaded = data_mod.load_hf(spec[len("hf:"):], tokenizer=tokenizer, column=column) if spec.startswith("hf:") \
        else None
    source = loaded if loaded is not None else hf if eval_data is None and hf is not None else data_mod.parse_data(spec)
    if isinstance(source, (data_mod.UserData, data_mod.Synthetic)):
        raise OptionError(f"--eval-every scores a held-out split, and {spec} has none; pass --eval-data with "
                          "digits, text:, jsonl: or hf: data")
    fit = data_mod.check_fit(source, _example_zeros(plan), None)
    rows = int(plan.inputs[0].shape[0]) if plan.inputs and plan.inputs[0].shape else 1
    data_mod.held_out_batches(source, rows * sched.num_microbatches * replicas, seq_len=fit.seq_len, max_batches=1,
                              layout=cast(Any, fit.layout), dtype=fit.dtype)  # at least one whole batch, or one line
    return loaded if eval_data is not None else None


def step_rows(doc: dict[str, Any], step_ms: list[float], batch: int,
              first: int) -> tuple[tuple[str, ...], tuple[tuple[Any, ...], ...]]:
    """The per-step table's columns and rows: steps counted from 1 (as metrics.jsonl and the checkpoints count
    them, ``first`` done before), the lr where it varies and the global gradient norm where it was computed."""
    lrs, norms = doc.get("lrs") or [], doc.get("grad_norms") or []
    show_lr = len({x for x in lrs if x is not None}) > 1
    show_norm = any(x is not None for x in norms)
    columns = ("step", "loss", *(("lr",) if show_lr else ()), *(("grad norm",) if show_norm else ()), "step ms",
               "samples/s")
    rows = tuple((first + 1 + j, round(loss, 6), *((float(f"{lrs[j]:.3g}"),) if show_lr else ()),
                  *((None if norms[j] is None else round(norms[j], 4),) if show_norm else ()),
                  round(ms, 2), round(batch / (ms / 1e3), 1))
                 for j, (loss, ms) in enumerate(zip(doc["losses"], step_ms)))
    return columns, rows


def write_ids(text: object, path: Path) -> Path:
    """``text``'s token ids (train, then held out) as one ``jsonl:`` document: the ranks' ``--data`` for a dataset
    the launcher tokenized (the same split: ``fxpipe.data.load_jsonl`` holds out the same last tenth)."""
    import torch

    assert isinstance(text.train, torch.Tensor) and isinstance(text.heldout, torch.Tensor)  # type: ignore[attr-defined]
    ids = torch.cat([text.train, text.heldout]).tolist()  # type: ignore[attr-defined]
    path.write_text(json.dumps(ids) + "\n")
    return path


def _held_out(plan_dir: Path, out_dir: Path, source: object, fit: object,
              trust_ops: tuple[str, ...]) -> dict[str, float]:
    """Every stage's final weights (as rank 0 gathered them) in one pipeline, scored on the held-out split
    (accuracy or loss)."""
    import torch

    import fxpipe
    from fxpipe import data

    pipe = fxpipe.load(plan_dir, trust_ops=trust_ops)
    params = {n: p for st in pipe.stage_list() for n, p in st.module.named_parameters(remove_duplicate=False)}
    for name, value in torch.load(out_dir / ranks.PARAMS, weights_only=True).items():
        with torch.no_grad():
            params[name].copy_(value)
    batch = int(pipe.plan.inputs[0].shape[0])
    pipe.eval()
    if isinstance(source, data.Digits):
        acc = source.evaluate(pipe, batch, layout=fit.layout, dtype=fit.dtype)  # type: ignore[attr-defined]
        return {"held-out accuracy %": round(100 * acc.accuracy, 2), "samples": acc.total}
    assert isinstance(source, data.Text)
    loss = source.evaluate(pipe, batch, fit.seq_len, max_batches=64)  # type: ignore[attr-defined]
    unit = "byte" if source.spec.startswith("text:") else "token"  # jsonl: and hf: are token ids
    return {"held-out loss": round(loss.loss, 4), f"bits per {unit}": round(loss.bits_per_byte, 4),
            "unigram loss": round(source.unigram_loss(), 4)}
