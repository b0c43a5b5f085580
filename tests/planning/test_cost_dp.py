"""Data parallelism in the cost model: the ring all-reduce per bucket, and memory per rank."""

from __future__ import annotations

import pytest

from fxpipe.errors import OptionError
from fxpipe.planning.cost import (
    BUCKET_BYTES,
    activation_memory,
    allreduce_bucket_seconds,
    allreduce_buckets,
    allreduce_seconds,
    rank_memory,
    static_memory,
)

MIB = 2**20


def test_ring_all_reduce_against_hand_computed_values() -> None:
    # 4 ranks, 1 GB/s, 10 us: a 10 MiB bucket sends 2 x 3/4 x 10 MiB and takes 2 x 3 latency steps.
    assert allreduce_seconds(10 * MIB, 4, 1e9, 1e-5) == pytest.approx(1.5 * 10 * MIB / 1e9 + 6e-5)
    assert allreduce_seconds(10 * MIB, 4, 1e9, 1e-5) == pytest.approx(0.01578864)
    # 2 ranks: 2(d-1)/d = 1; 8 ranks: 2 x 7/8 = 1.75, 14 latency steps.
    assert allreduce_seconds(1e6, 2, 1e9, 1e-5) == pytest.approx(1e-3 + 2e-5)
    assert allreduce_seconds(1e6, 8, 1e9, 1e-5) == pytest.approx(1.75e-3 + 14e-5)
    # 60 MiB is three buckets (25, 25, 10 MiB): the bytes term of one 60 MiB message, three latency terms.
    assert allreduce_buckets(60 * MIB) == (BUCKET_BYTES, BUCKET_BYTES, 10 * MIB)
    assert allreduce_bucket_seconds(60 * MIB, 4, 1e9, 1e-5) == pytest.approx(
        (1.5 * 25 * MIB / 1e9 + 6e-5,) * 2 + (1.5 * 10 * MIB / 1e9 + 6e-5,))
    assert allreduce_seconds(60 * MIB, 4, 1e9, 1e-5) == pytest.approx(0.09437184 + 3 * 6e-5)
    # A smaller bucket pays the latency more often.
    assert allreduce_seconds(60 * MIB, 4, 1e9, 1e-5, bucket_bytes=MIB) == pytest.approx(0.09437184 + 60 * 6e-5)


def test_nothing_to_reduce_costs_nothing() -> None:
    assert allreduce_seconds(10 * MIB, 1, 1e9, 1e-5) == 0.0  # one replica
    assert allreduce_seconds(0, 4, 1e9, 1e-5) == 0.0  # no parameters: not even latency
    assert allreduce_buckets(0) == () and allreduce_bucket_seconds(5, 1, 1.0, 1.0) == ()


def test_bad_dp_or_bucket_is_one_line() -> None:
    with pytest.raises(OptionError, match="at least 1 replica"):
        allreduce_seconds(1.0, 0, 1.0, 1.0)
    with pytest.raises(OptionError, match="bucket must hold at least one byte"):
        allreduce_buckets(1.0, 0)
    with pytest.raises(OptionError, match="no memory model for optimizer 'lamb'"):
        static_memory(1.0, "lamb")


def test_memory_per_rank_counts_parameters_gradients_optimizer_state_and_activations() -> None:
    assert [static_memory(100.0, o) for o in ("sgd", "momentum", "adam", "adamw")] == [200.0, 300.0, 400.0, 400.0]
    # The partitioner's 4 x parameter bytes is Adam's.
    acts = activation_memory("1f1b", 8, [10.0, 10.0], [4.0, 4.0])
    assert [rank_memory(p, a, "adam") for p, a in zip([50.0, 30.0], acts)] == [220.0, 130.0]
    assert rank_memory(50.0, acts[0]) == 120.0  # plain SGD, the runtime's default
