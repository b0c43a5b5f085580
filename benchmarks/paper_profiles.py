"""The committed cost profiles (benchmarks/profiles/) as plain values, for the paper comparisons (papers.py).

A profile is one model's per-layer F/B/W seconds, saved and parameter bytes, the bytes over each layer
boundary, and its strategy graph (``profile_layers.py`` writes them). ``gpu-<model>.json`` is preferred to
``cpu-<model>.json`` when both exist; ``links.json`` holds the link models (bandwidth, latency).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DIR = Path(__file__).parent / "profiles"
"""Where profiles are read from; papers.py --profiles sets it."""

COMPUTE_SCALE = 1.0
"""papers.py --compute-scale X: every profiled compute time divided by X (a device X times faster, the same bytes);
a what-if for CPU profiles, whose compute dwarfs every link."""


@dataclass(frozen=True)
class Profile:
    model: str
    source: str  # the file it came from, e.g. cpu-vgg-16-512.json
    doc: dict[str, Any]

    @property
    def names(self) -> list[str]:
        return [x["name"] for x in self.doc["layers"]]

    @property
    def times(self) -> list[float]:
        """Per layer, one microbatch's F + B + W seconds."""
        return [(x["f"] + x["b"] + x["w"]) / COMPUTE_SCALE for x in self.doc["layers"]]

    def field(self, name: str) -> list[float]:
        scale = 1.0 / COMPUTE_SCALE if name in ("f", "b", "w") else 1.0
        return [float(x[name]) * scale for x in self.doc["layers"]]

    @property
    def cut_bytes(self) -> list[float]:
        return [float(b) for b in self.doc["cut_bytes"]]

    @property
    def specs(self) -> list[dict[str, Any]]:
        """The strategy graph's layers (LayerSpec fields), compute divided by COMPUTE_SCALE."""
        return [dict(s, shape=tuple(s["shape"]), seconds=s["seconds"] / COMPUTE_SCALE,
                     fixed_seconds=s["fixed_seconds"] / COMPUTE_SCALE) for s in self.doc["specs"] or ()]

    @property
    def device(self) -> str:
        text = f"{self.doc['device']} ({self.doc['device_name']}, {self.doc['threads']} thread(s))" \
            if self.doc["device"] == "cpu" else f"{self.doc['device_name']}"
        return text if COMPUTE_SCALE == 1.0 else f"{text}, compute / {COMPUTE_SCALE:g}"


def load(model: str) -> Profile:
    """``model``'s profile from ``DIR``: the GPU one when present, else the CPU one."""
    for prefix in ("gpu", "cpu"):
        path = DIR / f"{prefix}-{model}.json"
        if path.exists():
            return Profile(model, path.name, json.loads(path.read_text()))
    raise FileNotFoundError(f"no profile of {model} in {DIR} (gpu-{model}.json or cpu-{model}.json); run "
                            f"python benchmarks/profile_layers.py --models {model}")


def links() -> dict[str, dict[str, Any]]:
    path = DIR / "links.json"
    if not path.exists():
        path = Path(__file__).parent / "profiles" / "links.json"
    return dict(json.loads(path.read_text()))


TOLERANCE = 0.20
"""Issue 44's bar for a model (simulation or cost model) against what this machine measured: within 20%."""


def model_over_measured(model: float, measured: float) -> float:
    """``model / measured`` (1.0 when both are 0, inf when only the measurement is)."""
    if measured == 0:
        return 1.0 if model == 0 else float("inf")
    return model / measured


def within(model: float, measured: float, tolerance: float = TOLERANCE) -> bool:
    """Whether ``model`` is within ``tolerance`` of ``measured`` (relative to the measurement)."""
    return abs(model_over_measured(model, measured) - 1.0) <= tolerance
