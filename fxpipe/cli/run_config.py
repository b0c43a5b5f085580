"""``fxpipe run``'s configuration: every option declared once (type, default, choices, help), in sections.

The command line (:func:`fxpipe.cli.config.command`), ``--config`` files, ``--print-config``, the log directory's
``config.toml``, the ranks' configuration file and the runtime's :class:`~fxpipe.runtime.options.RuntimeOptions`
(:meth:`RunConfig.runtime_options`) all come from :class:`RunConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from fxpipe.cli.config import Config, option, section
from fxpipe.errors import OptionError
from fxpipe.plan import DEFAULTS

if TYPE_CHECKING:
    from fxpipe.runtime.options import RuntimeOptions

WeightPolicy = Literal["stale", "stash", "predict", "predict-consistent"]  # fxpipe.schedules.versions.POLICIES
Resume = Literal["never", "auto", "always"]
MACHINES, HOST = "Across machines", "Host tuning"


@dataclass(frozen=True)
class Launch:
    """Where the ranks run: how many, on which machines, and how long one waits for another."""

    nproc: int | None = option(None, "Ranks to start on this machine (torchrun's --nproc-per-node; default: the "
                                  "schedule's ranks x --dp / --nnodes).", min=1)
    dp: int | None = option(None, "Replicas of the pipeline (data parallel): the run has the schedule's ranks x dp "
                               "ranks, each replica training on its share of a dp times bigger batch (default: the "
                               "plan's mesh).", min=1, flags=("--dp",))
    nnodes: int = option(1, "Machines in the run: start fxpipe run on each, with the same options and its own "
                         "--node-rank.", min=1, panel=MACHINES)
    node_rank: int = option(0, "This machine's place, 0 .. nnodes-1 (with --master-addr; node 0 is the machine at "
                            "--master-addr).", min=0, panel=MACHINES)
    master_addr: str | None = option(None, "Node 0's address, where the nodes meet (torchrun's static "
                                        "rendezvous).", panel=MACHINES)
    master_port: int | None = option(None, "Node 0's free port (default: 29500, torchrun's).", min=1, max=65535,
                                        panel=MACHINES)
    rdzv_endpoint: str | None = option(None, "HOST:PORT where the nodes meet instead (torchrun's c10d rendezvous; "
                                          "--node-rank is not needed, ranks go by arrival).", panel=MACHINES)
    rdzv_id: str = option("fxpipe", "The run's name at --rdzv-endpoint (the same on every node).", panel=MACHINES)
    rdzv_timeout: float = option(300.0, "Seconds a node waits for the others to join.", min=1.0, panel=MACHINES)
    timeout: float = option(60.0, "Seconds a rank waits for a peer before giving up; a run in which no rank moves "
                            "on for this long and 5 s more is stopped.")
    max_restarts: int = option(0, "Times torchrun's elastic agent restarts every rank when one fails (torchrun's "
                               "--max-restarts); with --resume auto they go on from the newest checkpoint.",
                               min=0, max=100)
    fail_rank: int = option(-1, "Fault injection for tests: this rank raises.", hidden=True, toml=False)
    kill_rank: int = option(-1, "Fault injection for tests: this rank is SIGKILLed mid-step.", hidden=True, toml=False)
    fault_step: int = option(1, "Fault injection for tests: the step, counted from the run's first, in which "
                             "--fail-rank or --kill-rank fires (the first attempt's only).", min=0, hidden=True,
                             toml=False)


@dataclass(frozen=True)
class Training:
    """What the ranks train: steps, the schedule, the loss, the weights an asynchronous schedule reads."""

    steps: int = option(3, "Optimizer steps.", min=1)
    schedule: str | None = option(None, "Schedule (default: the one recorded in the plan, else 1f1b).")
    microbatches: int | None = option(None, "Microbatches per step \\[default: the plan's: its recorded "
                                         "schedule's, or compile --microbatches; else 2 x stages].", min=1)
    loss: str | None = option(None, "FILE.py:FUNCTION or package.module:FUNCTION: the loss, (outputs, target) -> "
                                 "scalar tensor, on each microbatch (default: the built-in model's; required for "
                                 "your own model).")
    trust_ops: str | None = option(None, "LIB[,LIB...]: libraries whose torch.library operators the plan's stages "
                                      "may call, beyond transformers; only for plans you trust.")
    seed: int = option(0, "The real data's order and the stages' random ops (dropout): step k's batch and masks are "
                       "functions of seed and k.")
    weights: WeightPolicy = option("stash", "Asynchronous schedules (async-1f1b, layerpipe-async): the weights each "
                                   "phase reads: stale (the current ones), stash (PipeDream: its F's), predict "
                                   "(SpecTrain as the paper has it: F and B each extrapolated to the version current "
                                   "when the microbatch completes; needs --momentum) or predict-consistent (F "
                                   "extrapolated to the version its update applies to, B the same version).")
    recompute: Literal["none", "stage", "auto"] = option(
        "none", "With stage, every stage keeps only its inputs from F to B and B runs its forward again first (less "
        "activation memory, F's time again in B); auto, the stages the plan's --memory-per-stage cap needs (none "
        "without a cap). Synchronous schedules.")
    w_lane: bool = option(False, "Run each W on a second thread of its rank, beside the next F and B (LayerPipe's W "
                          "apart from B): it computes while the rank waits for a message. CPU ranks, one replica, "
                          "synchronous schedules.", flags=("--w-lane",))


@dataclass(frozen=True)
class Data:
    """Where the batches come from, and the held-out data evaluated on."""

    data: str = option("synthetic", "Training data: synthetic (one random batch shaped like the example), digits "
                       "(scikit-learn's handwritten digits; mlp-small), text:PATH or text:stdlib (bytes of a file or "
                       "of Python's own sources; gpt-small), jsonl:PATH (token ids, one JSON list or "
                       "{\"input_ids\": [...]} a line), hf:PATH (a Hugging Face dataset's text with --tokenizer; pip "
                       "install 'fxpipe\\[hf]'), or FILE.py:FUNCTION / package.module:FUNCTION: called once per rank "
                       "with a fxpipe.data.DataContext, it returns that rank's (inputs, target) batches. Built-in "
                       "real data reports held-out accuracy or loss.")
    data_workers: int = option(0, "Processes that read each rank's batches ahead (torch.utils.data.DataLoader's "
                               "num_workers; 0: the rank itself).", min=0)
    eval_data: str | None = option(None, "Held-out data to evaluate on (digits, text:, jsonl:, hf:; default: "
                                      "--data's held-out split).")
    eval_every: int = option(0, "Every N steps, the mean held-out loss without gradients (reduced over the "
                             "replicas), as eval_loss in metrics.jsonl (0: never). Synchronous schedules.", min=0)
    eval_batches: int = option(16, "Held-out batches each evaluation scores at most.", min=1)
    tokenizer: Path | None = option(None, "With --data hf:PATH: a tokenizer.json or a save_pretrained directory; "
                                       "documents are tokenized and packed with its end-of-text token between them.")
    data_column: str = option("text", "With --data hf:PATH: the dataset's text column.")


@dataclass(frozen=True)
class Optimizer:
    """The optimizer of every stage and its learning-rate schedule."""

    optimizer: Literal["sgd", "adamw"] = option("sgd", "sgd (with --momentum) or adamw (with --betas); one per "
                                                "stage, fp32 state.")
    lr: float = option(DEFAULTS.lr, "Learning rate; the peak of --lr-schedule.", min=0.0)
    momentum: float = option(0.0, "SGD momentum.", min=0.0, max=0.999)
    weight_decay: float = option(0.0, "Weight decay (AdamW's decoupled).", min=0.0)
    betas: str = option("0.9,0.999", "AdamW's B1,B2.")
    lr_schedule: Literal["constant", "cosine", "linear"] = option(
        "constant", "After --warmup-steps rising linearly from 0, constant or decaying to 0 at --steps; stepped once "
        "per step.")
    warmup_steps: int = option(0, "Steps of linear learning-rate warmup from 0.", min=0)
    skip_nonfinite: bool = option(False, "A step whose loss or global gradient norm is NaN or infinite updates no "
                                  "weight and the run goes on (said in metrics.jsonl as skipped); without it such a "
                                  "step stops the run. One all-reduce per step. Synchronous schedules.",
                                  flags=("--skip-nonfinite",))
    clip_grad_norm: float | None = option(None, "Clip the gradients to this global norm (over every stage and "
                                             "replica; one all-reduce per step, and the norm is reported per step).",
                                             show_default=False)


@dataclass(frozen=True)
class Compute:
    """Where and how each stage computes."""

    device: Literal["cpu", "cuda"] = option("cpu", "Where each rank trains: cpu, or cuda (rank r on GPU r mod the "
                                            "GPUs torch sees; ranks may share one; messages go through gloo, staged "
                                            "in pinned host memory). Pipeline plans.")
    precision: Literal["fp32", "bf16", "fp16"] = option("fp32", "fp32, or bf16 / fp16: autocast in the stage "
                                                        "graphs, fp32 weights and optimizer state (fp16 with a "
                                                        "dynamic loss scale).")
    codegen: Literal["eager", "inductor"] = option("eager", "eager, or inductor: each stage's F, B and W graphs "
                                                   "compiled (torch.compile, Inductor; a C++ compiler for CPU, else "
                                                   "eager with one line; compiled code cached in "
                                                   "~/.cache/fxpipe/inductor, never in the plan). Synchronous "
                                                   "schedules.")
    cuda_graphs: bool | None = option(None, "With --device cuda: replay each stage's F, B and W as CUDA graphs, "
                                         "captured in the second step (default: on for synchronous schedules with "
                                         "--codegen eager; a call that cannot be captured runs op by op).",
                                         show_default=False)


@dataclass(frozen=True)
class Checkpoint:
    """Where checkpoints go, how often, and whether the run resumes from one."""

    checkpoint_dir: Path | None = option(None, "Save a checkpoint here every --checkpoint-every steps and after "
                                            "the last (one directory per step).")
    resume: Resume = option("never", "never: start from step 0 (a non-empty --checkpoint-dir is refused); always: "
                            "from the newest complete checkpoint in --checkpoint-dir (none is an error; the old flag "
                            "--resume); auto: from it if there is one, else from step 0, so one command line "
                            "restarts a job.")
    overwrite: bool = option(False, "Replace the checkpoints in --checkpoint-dir (other files stay).")
    keep_checkpoints: int = option(3, "Complete checkpoints (steps) to keep.", min=1)
    checkpoint_every: int = option(1, "Steps between checkpoints (every schedule; an asynchronous one's pipeline "
                                   "drains at each, and a resumed run restarts it there, so larger is faster).", min=1)
    async_checkpoint: bool = option(False, "Write each checkpoint in the background (torch.distributed.checkpoint's "
                                    "async_save) while training goes on; each completes before the next starts and "
                                    "before the run ends.", flags=("--async-checkpoint",))


@dataclass(frozen=True)
class Logging:
    """What the run writes besides its tables."""

    log_dir: Path | None = option(None, "Write DIR/metrics.jsonl (one JSON line per step: loss, lr, gradient "
                                     "norm, step ms, samples/s, tokens/s, each rank's peak memory), DIR/config.toml "
                                     "(every option's value, for --config) and TensorBoard events if tensorboard is "
                                     "installed.")
    trace: Path | None = option(None, "Write the last step's measured timeline (Chrome trace; ranks on one "
                                   "machine share its clock).")
    as_json: bool = option(False, "One JSON object on stdout, nothing else.", flags=("--json",))
    plain: bool = option(False, "Plain-text tables.")


@dataclass(frozen=True)
class Host:
    """What each rank changes about its process (fxpipe.calibration.host.HostTuning)."""

    pin_ranks: bool = option(True, "Run each local rank on CPUs of its own (its equal share of this process's CPUs; "
                             "none where there are fewer CPUs than ranks).", panel=HOST)
    gloo_loop_nice: int = option(19, "Niceness of gloo's socket threads in each rank, so they cannot preempt the rank "
                                 "while it holds their lock (0 leaves them).", min=0, max=19, panel=HOST)
    send_yield: Literal["auto", "on", "off"] = option("auto", "Each rank yields its core once after each send, so "
                                                      "gloo's socket thread sends it now (auto: where the rank's "
                                                      "actions are short).", panel=HOST)
    keep_freed_memory: bool = option(True, "Keep freed memory in each rank (glibc's mmap and trim thresholds "
                                     "raised), so a step's large temporaries are reused instead of faulted in "
                                     "again.", panel=HOST)


@dataclass(frozen=True)
class RunConfig(Config):
    """``fxpipe run``'s every option, in sections (as ``--print-config`` writes them)."""

    plan_dir: Path = option(Path("plan"), "A plan directory written by fxpipe compile (of a built-in model, or of "
                            "your own with --loss); may come from --config's plan-dir key.", argument=True,
                            show_default=False)
    launch: Launch = section(Launch)
    training: Training = section(Training)
    data: Data = section(Data)
    optimizer: Optimizer = section(Optimizer)
    compute: Compute = section(Compute)
    checkpoint: Checkpoint = section(Checkpoint)
    logging: Logging = section(Logging)
    host: Host = section(Host)

    def check(self) -> None:
        """The checks across options that need no plan (the launcher checks the rest against the plan)."""
        from fxpipe.runtime.optim import LRSchedule, OptimizerSpec, parse_betas

        o = self.optimizer
        OptimizerSpec(o.optimizer, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay,
                      betas=parse_betas(o.betas))
        LRSchedule(o.lr_schedule, o.warmup_steps, self.training.steps)
        if o.clip_grad_norm is not None and not o.clip_grad_norm > 0:
            raise OptionError(f"--clip-grad-norm is the largest global gradient norm, > 0 (got {o.clip_grad_norm})")
        if not 0 < self.launch.timeout <= 7 * 86400:
            raise OptionError(f"--timeout is seconds a rank waits, more than 0 and at most a week (got "
                              f"{self.launch.timeout:g})")

    def host_tuning(self) -> Any:
        """The :class:`~fxpipe.calibration.host.HostTuning` the ranks apply."""
        from fxpipe.calibration.host import HostTuning

        h = self.host
        return HostTuning(pin_cpus=h.pin_ranks, gloo_loop_nice=h.gloo_loop_nice, send_yield=h.send_yield,
                          keep_freed_memory=h.keep_freed_memory)

    def runtime_options(self) -> RuntimeOptions:
        """The runtime's options for this run (``PipelineRuntime(..., options=config.runtime_options())``)."""
        from datetime import timedelta

        from fxpipe.runtime.optim import LRSchedule, OptimizerSpec, parse_betas
        from fxpipe.runtime.options import RuntimeOptions

        o, t, c = self.optimizer, self.training, self.compute
        return RuntimeOptions(
            optimizer=OptimizerSpec(o.optimizer, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay,
                                    betas=parse_betas(o.betas)),
            lr=o.lr, lr_schedule=LRSchedule(o.lr_schedule, o.warmup_steps, t.steps)
            if o.lr_schedule != "constant" or o.warmup_steps else None,
            clip_grad_norm=o.clip_grad_norm, precision=c.precision, microbatches=t.microbatches,
            timeout=timedelta(seconds=self.launch.timeout), weights=t.weights, codegen=c.codegen,
            cuda_graphs=c.cuda_graphs, recompute=t.recompute, w_lane=t.w_lane,
            keep_checkpoints=self.checkpoint.keep_checkpoints, async_checkpoint=self.checkpoint.async_checkpoint,
            skip_nonfinite=o.skip_nonfinite)
