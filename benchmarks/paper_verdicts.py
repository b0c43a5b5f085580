"""Each paper's headline as a number with its baseline, and the pure rule that grades a table against it.

A claim is met ("reproduced") when every part reaches the paper's number, "partly" when every part reaches
``PARTLY`` of the claimed gain (half the gain over the baseline), else "not reproduced"; the word comes with the
reason, so a table's verdict follows from its numbers and these thresholds alone (tests reach every word).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

PARTLY = 0.5
"""The fraction of a claimed gain that earns "partly": half the gain over the paper's baseline."""

WORDS = ("reproduced", "partly", "not reproduced")


@dataclass(frozen=True)
class Part:
    """One number of a headline: ``what`` measured against ``claim``, a gain over ``base`` (1.0 for a speedup
    ratio, 0.0 for a fraction saved or a gain already relative)."""

    what: str
    got: float
    claim: float
    base: float = 0.0

    @property
    def partly_at(self) -> float:
        return self.base + PARTLY * (self.claim - self.base)

    @property
    def word(self) -> str:
        return WORDS[0] if self.got >= self.claim else WORDS[1] if self.got >= self.partly_at else WORDS[2]

    def text(self, fmt: str) -> str:
        return (f"{self.what} {format(self.got, fmt)} against the paper's {format(self.claim, fmt)} "
                f"(half the gain: {format(self.partly_at, fmt)})")


def grade(parts: Sequence[Part]) -> str:
    """The worst word over ``parts``: every part must meet the claim for "reproduced", half its gain for "partly"."""
    if not parts:
        return WORDS[2]
    return WORDS[max(WORDS.index(p.word) for p in parts)]


def sentence(claim: str, parts: Sequence[Part], fmt: str, where: str) -> str:
    """The verdict line: the word, the headline with its baseline, each part's number against it, and where."""
    word = grade(parts)
    body = "; ".join(p.text(fmt) for p in parts) if parts else "no row to grade"
    return f"**Verdict: {word}** ({where}). Headline: {claim}. Here: {body}."


# --- the five headlines --------------------------------------------------------------------------------------


LAYERPIPE = "LayerPipe >= 1.25x PipeDream on average and >= 1.80x at best, at 7-9 processors (arXiv 2108.06629 abstract)"


def layerpipe(gains: Sequence[float]) -> list[Part]:
    """``gains``: LayerPipe's speedup over PipeDream - 1 at 7-9 stages, one per row graded."""
    if not gains:
        return []
    return [Part("average gain", sum(gains) / len(gains), 0.25), Part("best gain", max(gains), 0.80)]


SPECTRAIN = ("SpecTrain up to 8.91x data parallelism's throughput on 4 GPUs, 'comparable accuracy' "
             "(arXiv 1809.02839 abstract)")


def spectrain(speedups: Sequence[float]) -> list[Part]:
    """``speedups``: SpecTrain's samples/s over data parallelism's, 4 stages against 4 replicas, per row."""
    return [Part("best speedup over data parallelism", max(speedups), 8.91, base=1.0)] if speedups else []


def spectrain_accuracy(predict: Sequence[float], stale: Sequence[float], sync: Sequence[float]) -> tuple[str, str]:
    """Whether predict's mean gain over stale exceeds the spread (the larger standard deviation over seeds of the
    two), and whether predict's mean is within sync's standard deviation of sync's or above (the paper's 'comparable
    accuracy'): (word, reason). The seeds are paired (same start, same batches): the reason counts predict's wins."""
    import statistics

    gain = statistics.mean(predict) - statistics.mean(stale)
    spread = max(statistics.pstdev(predict), statistics.pstdev(stale))
    span = max(max(predict) - min(predict), max(stale) - min(stale))
    wins = sum(p > s for p, s in zip(predict, stale))
    beats = gain > spread
    comparable = statistics.mean(predict) >= statistics.mean(sync) - statistics.pstdev(sync)
    word = WORDS[0] if beats and comparable else WORDS[1] if beats or (gain > 0 and comparable) else WORDS[2]
    return word, (f"predict's mean over stale's {gain:+.3f}, {'larger' if beats else 'not larger'} than the larger "
                  f"standard deviation of the two ({spread:.3f}; the larger min-max range is {span:.3f}); predict above "
                  f"stale on {wins} of {len(predict)} paired seeds; predict's mean {statistics.mean(predict):.3f} "
                  f"against sync's {statistics.mean(sync):.3f} (sync's standard deviation "
                  f"{statistics.pstdev(sync):.3f}): {'comparable' if comparable else 'below sync by more than that'}")


SPLITBRAIN = ("SplitBrain saves up to 67% of memory against data parallelism with near-linear speedup (speedup / ranks "
              ">= 0.8 taken as near-linear) for VGG on CIFAR-10 (arXiv 2112.15317 abstract)")


def splitbrain(saved: float, efficiency: float) -> list[Part]:
    """``saved``: the largest fraction of model state saved per rank against dp, in the paper's setting;
    ``efficiency``: SplitBrain's speedup / ranks at the most ranks (the caller says what dp reaches there: a part
    dp meets too does not tell the two apart)."""
    return [Part("model state saved", saved, 0.67), Part("speedup / ranks", min(efficiency, 1.0), 0.8)]


OPTCNN = ("OptCNN's layer-wise strategy >= 1.4x data parallelism's throughput at 16 GPUs (the low end of the "
          "1.4-2.2x recalled in PAPERS.md 2b, marked unverified there: the paper's body was not readable)")


def optcnn(speedups: Sequence[float]) -> list[Part]:
    """``speedups``: the search's throughput over data parallelism's at the most ranks, one per model; graded on the
    best model, as the paper reports its best networks."""
    return [Part("best throughput over data parallelism", max(speedups), 1.4, base=1.0)] if speedups else []


AKINTOYE = ("Akintoye et al.: 'almost linear speedup' with partitioning and merging (speedup / devices >= 0.8 taken "
            "as almost linear, at 8 devices), outperforming data parallelism (arXiv 2207.11019 abstract)")


def akintoye(efficiency: float, over_dp: float) -> list[Part]:
    """``efficiency``: merging's best S(N)/N at the most devices; ``over_dp``: merging's best S(N) over data
    parallelism's there ('outperforming' has no half: below 1.0 is not met)."""
    return [Part("S(N)/N", efficiency, 0.8), Part("S(N) over data parallelism's", over_dp, 1.0, base=1.0)]
