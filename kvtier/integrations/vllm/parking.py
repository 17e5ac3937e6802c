"""When a recall should park its request (`park: when_cheaper`): the cost of waiting a step
against the batch's wait.

A recall before the forward holds up every request of the step by the copy's time; a parked
request (vLLM's asynchronous load) holds up nobody, but waits for the step under way to end and
runs on the next one. So parking pays only when the others' wait would be the larger:

    park  when  others running x recall time  >  one step's time

The recall time is fitted to the engine's own recalls lately (the workers time them and report
through vLLM's connector stats) as a fixed cost plus the bytes over a bandwidth, or is the bytes
over the operator's `recall_gbps` when set; the step time is the scheduler's own interval
between steps that ran work. Until both are known the rule parks whenever others run. On a CPU
engine a step takes hundreds of milliseconds and a recall a few: recalls run before the
forward. On a GPU, a recall of a long prompt beside a large decode batch parks.

It is not the default. On the CPU serving bench (docs/integrations-vllm.md) runs with two
compute threads per engine once showed parking whenever others run giving the better TTFT over
all turns, against this model; with one thread (the bench's noise taken out) the two gave the
same first turns and TTFT means within 10%, as it predicts for recalls of milliseconds. Which
wins on a GPU, where it parks, is not measured yet: the default stays until it is.

Verbs: `ParkingRule.parks`, `.step_started`, `.recalls_timed`, `.recall_s`; `RecallTimes` (a
worker's recalls since the last report).
"""

from __future__ import annotations

import threading
import time

# Weight of the newest observation in the running estimates: a few steps of history, so a
# change of load shows within a second or two of steps.
NEWEST_WEIGHT = 0.25


class ParkingRule:
    """The scheduler's estimate of a step's and a recall's time, and the choice it gives."""

    def __init__(self, recall_gbps: float = 0.0) -> None:
        self._fixed_bytes_per_s = recall_gbps * 1e9  # 0: measured
        # Decayed sums over timed recalls of weight, bytes x, seconds y, x * x and x * y: a
        # recall's time is fitted as a fixed cost plus bytes over a bandwidth, so a small
        # recall (mostly the round trip) does not make a large one look slow.
        self._sums = [0.0] * 5
        self._step_s = 0.0  # running estimate; 0: no step with work seen yet
        self._last_start: float | None = None  # when the step under way started, if it ran work
        self.num_reports = 0  # recall times received

    def step_started(self, ran_work: bool, now: float | None = None) -> None:
        """A step was planned (`ran_work`: it schedules tokens): the previous one, if it ran
        work, has ended."""
        now = time.monotonic() if now is None else now
        if self._last_start is not None:
            sample = now - self._last_start
            self._step_s = sample if not self._step_s else (
                (1 - NEWEST_WEIGHT) * self._step_s + NEWEST_WEIGHT * sample)
        self._last_start = now if ran_work else None

    def recalls_timed(self, num_bytes: float, seconds: float, count: int = 1) -> None:
        """`count` recalls moved `num_bytes` in `seconds`, summed over them."""
        if num_bytes <= 0 or seconds <= 0 or count <= 0:
            return
        self.num_reports += 1
        x, y = num_bytes / count, seconds / count
        keep = 1 - NEWEST_WEIGHT if self._sums[0] else 0.0
        self._sums = [keep * old + NEWEST_WEIGHT * count * new
                      for old, new in zip(self._sums, (1.0, x, y, x * x, x * y))]

    def recall_s(self, num_bytes: float) -> float:
        """The expected time of a recall of `num_bytes`; 0 while unknown."""
        if self._fixed_bytes_per_s:
            return num_bytes / self._fixed_bytes_per_s
        weight, sum_x, sum_y, sum_xx, sum_xy = self._sums
        if not weight:
            return 0.0
        spread = weight * sum_xx - sum_x * sum_x
        if spread > 1e-9 * weight * sum_xx:  # recalls of several sizes: fit both parts
            per_byte = (weight * sum_xy - sum_x * sum_y) / spread
            fixed = (sum_y - per_byte * sum_x) / weight
            if per_byte > 0 and fixed >= 0:
                return fixed + per_byte * num_bytes
        return num_bytes * sum_y / sum_x  # one size seen: in proportion to it

    def measured_bytes_per_s(self) -> float:
        """The bandwidth the engine's recalls reached lately (bytes over seconds); 0 before
        any."""
        return self._sums[1] / self._sums[2] if self._sums[2] else 0.0

    @property
    def step_estimate_s(self) -> float:
        """The running estimate of a step's time, from steps that ended; 0 before any."""
        return self._step_s

    def step_s(self, now: float | None = None) -> float:
        """A step's expected time: the running estimate, or the step under way so far when
        that is longer (the first steps of an engine, a step slower than the ones before)."""
        under_way = 0.0
        if self._last_start is not None:
            under_way = (time.monotonic() if now is None else now) - self._last_start
        return max(self._step_s, under_way)

    def parks(self, num_bytes: int, num_others: int, now: float | None = None) -> bool:
        """Whether a recall of `num_bytes` should park its request while `num_others` other
        requests are running."""
        if num_others <= 0:
            return False  # nothing to overlap: the copy alone
        recall_s, step_s = self.recall_s(num_bytes), self.step_s(now)
        if not recall_s or not step_s:
            return True  # no measure yet: never hold the others up on a guess
        return num_others * recall_s > step_s


class RecallTimes:
    """A worker's finished recalls since the last report: bytes and seconds, summed. The
    recall thread adds, vLLM's step thread takes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bytes = 0
        self._seconds = 0.0
        self._count = 0

    def add(self, num_bytes: int, seconds: float) -> None:
        with self._lock:
            self._bytes += num_bytes
            self._seconds += seconds
            self._count += 1

    def take(self) -> tuple[int, float, int]:
        """(bytes, seconds, recalls) since the last call; zeros when none finished."""
        with self._lock:
            taken = (self._bytes, self._seconds, self._count)
            self._bytes, self._seconds, self._count = 0, 0.0, 0
        return taken
