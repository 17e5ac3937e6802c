"""The request latency histogram: Prometheus's bucket rule, and exact counts from many threads;
the recent-window percentiles `kvtier stats` shows."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvtier.daemon.service_stats import percentiles
from kvtier.store.stats import LATENCY_BUCKETS_S, LatencyHistogram


def test_a_value_on_a_bound_counts_in_that_bucket_and_a_slow_one_past_the_last() -> None:
    histogram = LatencyHistogram()
    histogram.observe(LATENCY_BUCKETS_S[0])  # le="1e-05" holds 1e-05 itself
    histogram.observe(LATENCY_BUCKETS_S[0] * 1.01)
    histogram.observe(LATENCY_BUCKETS_S[-1] * 2)

    snapshot = histogram.snapshot()

    assert snapshot["bucket_counts"][:2] == [1, 1]
    assert snapshot["bucket_counts"][-1] == 1
    assert len(snapshot["bucket_counts"]) == len(LATENCY_BUCKETS_S) + 1
    assert snapshot["total"] == 3
    assert abs(snapshot["sum_s"] - (2.01 * LATENCY_BUCKETS_S[0] + 2 * LATENCY_BUCKETS_S[-1])) < 1e-9


def test_no_observation_is_lost_between_threads_or_when_a_thread_ends() -> None:
    histogram = LatencyHistogram()
    num_threads, per_thread = 6, 20_000
    start = threading.Barrier(num_threads)

    def record(seconds: float) -> None:
        start.wait()
        for _ in range(per_thread):
            histogram.observe(seconds)

    threads = [threading.Thread(target=record, args=(LATENCY_BUCKETS_S[i],))
               for i in range(num_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    snapshot = histogram.snapshot()
    assert snapshot["bucket_counts"][:num_threads] == [per_thread] * num_threads
    assert snapshot["total"] == num_threads * per_thread


@pytest.mark.parametrize("num_samples", [1, 2, 3, 7, 100, 4096])
def test_window_percentiles_are_numpys_linearpercentiles(num_samples: int) -> None:
    values = np.random.default_rng(num_samples).lognormal(size=num_samples)

    assert np.allclose(percentiles(values, (50.0, 99.0)), np.percentile(values, (50, 99)))
