"""The parking rule of the vLLM connector's scheduler (no vLLM needed): a recall parks its
request only when the running requests would wait longer for the copy than it waits for a step.
Times are given, not slept."""

from __future__ import annotations

import threading

import pytest

from kvtier.integrations.vllm.parking import ParkingRule, RecallTimes

MB = 10**6


def rule_after(step_s: float, recall_bytes_per_s: float, steps: int = 4) -> ParkingRule:
    """A rule that has seen `steps` steps of `step_s` each with work and recalls at
    `recall_bytes_per_s`; the step under way started at time `steps * step_s`."""
    rule = ParkingRule()
    for step in range(steps + 1):
        rule.step_started(True, now=step * step_s)
    rule.recalls_timed(recall_bytes_per_s, 1.0)
    return rule


def test_nothing_running_never_parks() -> None:
    rule = rule_after(0.2, 1e9)
    assert not rule.parks(10**12, 0, now=0.8)


def test_until_a_step_and_a_recall_are_timed_a_recall_beside_others_parks() -> None:
    rule = ParkingRule()
    assert rule.parks(MB, 1, now=0.0)
    rule.step_started(True, now=0.0)
    assert rule.parks(MB, 1, now=0.1)  # a step under way, no recall timed yet
    rule.recalls_timed(10 * MB, 0.01)
    assert not rule.parks(MB, 1, now=0.1)  # 1 ms for the others, against a 100 ms step


@pytest.mark.parametrize(("num_bytes", "num_others", "parks"), [
    (10 * MB, 3, False),  # 3 x 10 ms < 100 ms: the others barely wait
    (40 * MB, 3, True),  # 3 x 40 ms > 100 ms: the request waits a step instead
    (40 * MB, 2, False),  # 2 x 40 ms < 100 ms
    (200 * MB, 1, True),  # 200 ms of copy against a 100 ms step
])
def test_it_parks_when_the_others_would_wait_longer_than_a_step(
        num_bytes: int, num_others: int, parks: bool) -> None:
    rule = rule_after(0.1, 1e9)  # steps of 100 ms, 1 GB/s: a MB is a ms
    assert rule.parks(num_bytes, num_others, now=0.45) is parks


def test_a_fixed_bandwidth_replaces_the_measured_one() -> None:
    rule = ParkingRule(recall_gbps=0.001)  # 1 MB/s, whatever the recalls reach
    rule.step_started(True, now=0.0)
    rule.recalls_timed(10**12, 1.0)
    assert rule.recall_s(MB) == pytest.approx(1.0)
    assert rule.parks(MB, 1, now=0.1)  # a second of copy against a 100 ms step


def test_idle_time_between_steps_is_not_a_step() -> None:
    rule = ParkingRule()
    rule.step_started(True, now=0.0)
    rule.step_started(False, now=0.1)  # a 100 ms step, then nothing ran
    rule.step_started(True, now=60.0)  # a minute idle: not a step
    assert rule.step_s(now=60.0) == pytest.approx(0.1)
    # The step under way counts once it runs longer than the estimate.
    assert rule.step_s(now=60.5) == pytest.approx(0.5)


def test_the_estimates_follow_a_change_within_a_few_steps() -> None:
    rule = rule_after(0.1, 1e9)
    now = 0.4
    for _ in range(8):  # the engine slows to 1 s steps
        now += 1.0
        rule.step_started(True, now=now)
    assert rule.step_s(now=now) > 0.85
    for _ in range(12):  # and recalls to 100 MB/s (from 1 GB/s)
        rule.recalls_timed(100 * MB, 1.0)
    assert rule.recall_s(100 * MB) > 0.9


def test_recall_times_are_summed_across_threads_and_taken_once() -> None:
    times = RecallTimes()

    def add() -> None:
        for _ in range(1000):
            times.add(4096, 0.001)

    threads = [threading.Thread(target=add) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    num_bytes, seconds, count = times.take()
    assert (num_bytes, count) == (4 * 1000 * 4096, 4000)
    assert seconds == pytest.approx(4.0)
    assert times.take() == (0, 0.0, 0)


def test_a_small_recall_s_round_trip_does_not_make_a_large_one_look_slow() -> None:
    """Recalls cost a fixed round trip plus their bytes over the link: fitted from recalls of
    two sizes, a large one is predicted from the link, not from the small one's round trip."""
    rule = ParkingRule()
    rule.step_started(True, now=0.0)
    rule.recalls_timed(1 * MB, 0.011)  # 10 ms round trip + 1 ms a MB
    assert rule.recall_s(32 * MB) == pytest.approx(0.352)  # one size seen: in proportion
    assert rule.parks(32 * MB, 3, now=1.0)  # 3 x 352 ms against a 1 s step
    rule.recalls_timed(4 * MB, 0.014)
    assert rule.recall_s(32 * MB) == pytest.approx(0.042)
    assert not rule.parks(32 * MB, 3, now=1.0)  # 3 x 42 ms


def test_recalls_reported_together_count_each_round_trip() -> None:
    rule = ParkingRule()
    rule.recalls_timed(4 * MB, 0.044, count=4)  # four recalls of 1 MB, 11 ms each
    rule.recalls_timed(8 * MB, 0.028, count=2)  # two of 4 MB, 14 ms each
    assert rule.recall_s(32 * MB) == pytest.approx(0.042)
