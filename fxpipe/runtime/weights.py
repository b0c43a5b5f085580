"""Weight versions for asynchronous training: what each F, B and W reads under each policy.

``fxpipe.schedules.versions`` says, from the schedule alone, which version each phase reads;
this module makes those tensors and hands them to the graphs (``torch.func.functional_call``
puts them where the graph's ``get_attr`` nodes look). F's saved tensors that are, or are views
of, the weights F read are remembered by position, so a later phase that reads other weights
gets them there too.

    stale    every phase reads the live parameters
    stash    F snapshots the live weights when the stage's version has moved since the last
             snapshot; B and W read that snapshot; a version is freed once no microbatch in
             flight holds it (reference counting does it: F's saved tensors are what hold it).
             The next snapshot is copied into the last one no microbatch reads any more (their
             W has run, and with it every tensor of theirs that could point into it), so a
             step copies weights without fresh allocations (a fresh 16 MiB on a CPU page-faults
             in: 4x the copy here); the spare counts as held until it is reused.
    predict, predict-consistent
             each phase reads W - ahead * lr * v (SpecTrain), made when the phase runs and
             dropped after it (F's saved tensors point back at the live weights): at most one
             prediction per stage is alive, none between actions. v, the smoothed step:
               SGD with momentum:  v = momentum buffer                 (update: W -= lr * v)
               Adam / AdamW:       v = m_hat / (sqrt(v_hat) + eps)      (update: W -= lr * v)
             weight decay is not extrapolated; other optimizers are refused.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from fxpipe.errors import OptionError
from fxpipe.schedules.ir import Schedule
from fxpipe.schedules.versions import POLICIES, PREDICT, Read, predicts, reads, timings

Weights = dict[str, torch.Tensor]


class WeightVersions:
    """The weights each (stage, microbatch, phase) of an asynchronous schedule reads, per policy.

    ``stages[s]`` is stage s's module and ``optimizers[s]`` the optimizer over its parameters;
    the executor calls :meth:`updated` after each optimizer step of a stage.
    """

    def __init__(self, schedule: Schedule, policy: str, stages: Mapping[int, torch.nn.Module],
                 optimizers: Mapping[int, torch.optim.Optimizer]) -> None:
        if policy not in POLICIES:
            raise OptionError(f"unknown weight policy {policy!r}; use one of {', '.join(POLICIES)}")
        self.policy = policy
        self.table: dict[tuple[int, int, str], Read] = reads(schedule, policy)
        self.params = {s: dict(mod.named_parameters(remove_duplicate=False)) for s, mod in stages.items()}
        self.optimizers = dict(optimizers)
        self.version = {s: 0 for s in stages}
        self.timing = timings(schedule)
        self._snapshot: dict[int, tuple[int, Weights]] = {}  # stash: stage -> (version, tensors) of its last F
        self._held: dict[tuple[int, int], tuple[int, Weights]] = {}  # stash: (version, tensors) a microbatch's F read
        self._readers: dict[tuple[int, int], int] = {}  # stash: (stage, version) -> microbatches whose W is to come
        self._spare: dict[int, Weights] = {}  # stash: stage -> a snapshot no microbatch reads, for the next one
        self.snapshots = {s: [0, 0] for s in stages}  # stash, per stage: snapshots made [new, into a spare]
        self._aliases: dict[int, list[tuple[int, str, Any]]] = {}  # stage -> F's saved slots holding weights
        self._detached: dict[tuple[int, str], torch.Tensor] = {}  # the live parameters, detached once
        self.log: list[tuple[int, int, str, int, int]] = []  # (stage, mb, phase, version, ahead) as read
        self._alive: dict[int, list[weakref.ref[torch.Tensor]]] = {s: [] for s in stages}  # predictions not freed
        self.most_alive = {s: 0 for s in stages}  # per stage, the most predictions alive at once (measured)
        if policy in PREDICT:
            for s, opt in self.optimizers.items():
                _check_predictable(opt, s)

    def updated(self, s: int) -> None:
        """Stage s applied one optimizer step."""
        self.version[s] += 1

    def weights(self, s: int, m: int, phase: str) -> Weights | None:
        """The tensors phase ``phase`` of microbatch m on stage s reads by parameter name; None: the live ones."""
        read, t = self.table[(s, m, phase)], self.timing[(s, m)]
        now = {"F": t.f, "B": t.b, "W": t.w}[phase]
        if now != self.version[s]:
            raise OptionError(f"stage {s} is at weight version {self.version[s]} when {s}{phase}{m} runs, the "
                              f"schedule says {now}; run the schedule's actions in its order")
        self.log.append((s, m, phase, read.version, read.ahead))
        if self.policy == "stale":
            return None
        if self.policy == "stash":
            if phase == "F":
                have = self._snapshot.get(s)
                if have is None or have[0] != read.version:
                    if have is not None and not self._readers.get((s, have[0])):
                        self._spare[s] = have[1]  # the last snapshot, read by no microbatch in flight
                    have = (read.version, self._copy(s))
                    self._snapshot[s] = have
                self._held[(s, m)] = have
                self._readers[(s, have[0])] = self._readers.get((s, have[0]), 0) + 1
                return have[1]
            if phase == "B":
                return self._held[(s, m)][1]
            version, weights = self._held.pop((s, m))
            left = self._readers.pop((s, version)) - 1
            if left:
                self._readers[(s, version)] = left
            elif self._snapshot[s][0] != version:  # no later F reads it: the next snapshot goes into it
                self._spare[s] = weights
            return weights
        if not predicts(read):
            return None
        weights = self._predict(s, read.ahead)
        alive = [r for r in self._alive[s] if r() is not None]  # CPython frees a dropped prediction at once
        alive += [weakref.ref(t) for n, t in weights.items() if t is not self._live(s, n)][:1]
        self._alive[s] = alive
        self.most_alive[s] = max(self.most_alive[s], len(alive))
        return weights

    def spare(self, s: int) -> list[torch.Tensor]:
        """Stash: the tensors of stage s's spare snapshot (memory held for the next snapshot; empty: none)."""
        return list(self._spare.get(s, {}).values())

    def _copy(self, s: int) -> Weights:
        """A snapshot of stage s's live weights: copied into its spare if it has one, else new tensors."""
        spare = self._spare.pop(s, None)
        self.snapshots[s][spare is not None] += 1
        with torch.no_grad():
            if spare is None:
                return {n: p.detach().clone() for n, p in self.params[s].items()}
            for n, p in self.params[s].items():
                spare[n].copy_(p)
        return spare

    def remember_aliases(self, s: int, passed: Weights | None, saved: Sequence[Any]) -> None:
        """After F: which of its saved tensors are the weights it read (or views of them), by name."""
        if s in self._aliases or self.policy not in PREDICT:
            return
        by_id = {id(t): n for n, t in (passed or self.params[s]).items()}
        found: list[tuple[int, str, Any]] = []  # (slot, weight, None or the view's size, stride and offset)
        for i, t in enumerate(saved):
            if not isinstance(t, torch.Tensor):
                continue
            if id(t) in by_id:
                found.append((i, by_id[id(t)], None))
            elif t._base is not None and id(t._base) in by_id:
                found.append((i, by_id[id(t._base)], (t.size(), t.stride(), t.storage_offset())))
        self._aliases[s] = found

    def rebase_saved(self, s: int, saved: list[Any], weights: Weights | None) -> list[Any]:
        """F's saved tensors with the weights in them replaced by ``weights`` (the live ones if None)."""
        if self.policy not in PREDICT:
            return saved
        source = weights if weights is not None else {n: self._live(s, n) for n in self.params[s]}
        out = list(saved)
        for i, name, view in self._aliases.get(s, ()):
            out[i] = source[name] if view is None else source[name].as_strided(*view)
        return out

    def _live(self, s: int, name: str) -> torch.Tensor:
        return self._detached.setdefault((s, name), self.params[s][name].detach())

    def _predict(self, s: int, ahead: int) -> Weights:
        """Stage s's weights ``ahead`` updates on, new tensors; a parameter the optimizer has not stepped yet (no
        smoothed gradient) reads its live value."""
        opt = self.optimizers.get(s)
        out: Weights = {}
        with torch.no_grad():
            for name, p in self.params[s].items():
                step = _smoothed_step(opt, p) if opt is not None else None
                if step is None:
                    out[name] = self._live(s, name)
                else:  # one pass, one new tensor: W - ahead * scale * v
                    v, scale = step
                    out[name] = torch.add(p.detach(), v, alpha=-ahead * scale)
        return out


def _check_predictable(opt: torch.optim.Optimizer, s: int) -> None:
    if isinstance(opt, torch.optim.SGD):
        if any(g.get("momentum", 0) == 0 for g in opt.param_groups):
            raise OptionError(f"stage {s}'s SGD has no momentum, so there is no smoothed gradient to predict weights "
                              "with; give SGD momentum (e.g. 0.9), use Adam, or use --weights stash")
        if any(g.get("nesterov") for g in opt.param_groups):
            raise OptionError(f"stage {s}'s SGD is Nesterov, which weight prediction does not model; use plain "
                              "momentum or --weights stash")
        return
    if isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
        if any(g.get("amsgrad") for g in opt.param_groups):
            raise OptionError(f"stage {s}'s Adam uses amsgrad, which weight prediction does not model; turn it off "
                              "or use --weights stash")
        return
    raise OptionError(f"stage {s}'s optimizer is {type(opt).__name__}; weight prediction knows momentum SGD, Adam "
                      "and AdamW: use one of those or --weights stash")


def _smoothed_step(opt: torch.optim.Optimizer, p: torch.Tensor) -> tuple[torch.Tensor, float] | None:
    """(v, scale): the step the optimizer would take now from its smoothed gradient is scale * v (SGD: the momentum
    buffer and lr; Adam: exp_avg / (sqrt(v_hat) + eps), one new tensor, and lr over beta1's bias correction); None
    before its first step."""
    state = opt.state.get(p)
    if not state:
        return None
    group = next(g for g in opt.param_groups if any(q is p for q in g["params"]))
    lr = float(group["lr"])
    if isinstance(opt, torch.optim.SGD):
        buf = state.get("momentum_buffer")
        return None if buf is None else (buf, lr)
    beta1, beta2 = group["betas"]
    step = float(state["step"])
    denom = state["exp_avg_sq"].div(1 - beta2 ** step).sqrt_().add_(group["eps"])
    return torch.div(state["exp_avg"], denom, out=denom), lr / (1 - beta1 ** step)
