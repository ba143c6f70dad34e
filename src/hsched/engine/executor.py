"""Executing placed tasks: the interface a backend implements, and the local simulated executor.

The placer decides and records; an executor runs. The placer hands every task it allocates to its executor
(`launch`), and — after taking a DC over from another placer, or after a restart — every task its ledger shows
allocated, with the clock data the ledger recorded (`TaskClock`). The executor reports back through the sink
the placer attached: `run` when the task started, `done` when it finished (ok or failed). The placer writes
each report to the ledger behind its fencing token, so a placer that lost its lease writes nothing; it
ignores reports that no longer match its ledger (a task released meanwhile, or placed anew since). Release
and preemption `stop` a task; losing the lease stops reporting altogether (`stop_all`).

Reports carry the time the transition happened (unix ms), not the time the placer heard of it: a task keeps
running while its placer is down, and its completion is recorded at the time it completed.

`SimulatedExecutor` runs nothing: a task starts `scheduling delay + container start` (+ the preemption
overhead its alloc recorded, when it evicted others) after it was placed and runs `runtime_s` (task time);
task time passes `time_factor` times faster than wall time. The overheads are paper 001's (JobFusion §3.1):
scheduling delay 0.4-1.0 s (mean 0.7 s, its measured decision latency), container initialisation 1-10 s,
preemption/context switch 5-25 s (`preemption_overhead_s`; the placer also keeps the victims from being placed
again before it has passed). Each is a fixed value or a uniform range, drawn
per task placement from a generator seeded by (seed, task, placement time): a placer that takes over draws
the same numbers and resumes the same clock. With `fail_probability` p a placement fails with probability p
at a uniformly drawn point of its runtime (same seeding).
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

from hsched.domain.cluster import Part, TaskClock
from hsched.domain.errors import ValidationError


@dataclass(frozen=True, slots=True)
class Report:
    """An executor's account of a task: `run` (started at `at_ms`) or `done` (finished at `at_ms`, ok or not).
    `placed_ms` is the placement it is about (TaskClock.placed_ms); `started_ms` on a done says when it started
    (the placer records the start first if it has not yet)."""

    kind: str  # run | done
    task_id: str
    placed_ms: int
    at_ms: int
    ok: bool = True
    reason: str = ""
    started_ms: int = 0


ReportSink = Callable[[Report], None]


class Executor(ABC):
    """Runs the placer's tasks; a real backend (containers, batch jobs) implements these five methods."""

    @abstractmethod
    def attach(self, sink: ReportSink) -> None:
        """Where to report (called once by the placer, before any launch). The sink is called on the event
        loop and never blocks; reports may be repeated or stale (the placer checks them against its ledger)."""

    @abstractmethod
    def launch(self, task_id: str, parts: tuple[Part, ...], clock: TaskClock) -> None:
        """Run `task_id` on `parts`, or — when it already runs (a take-over, a restart) — keep it running and
        report what is still to come. `clock.started_ms` set = it started then; the report of a transition
        that happened while nobody listened is due at once."""

    @abstractmethod
    def stop(self, task_id: str) -> None:
        """Released or preempted: stop the task; report nothing more about it."""

    @abstractmethod
    def stop_all(self) -> None:
        """This placer no longer owns the DC: report nothing more (the next owner re-launches from its ledger)."""

    @property
    @abstractmethod
    def time_factor(self) -> float:
        """Task seconds per wall second (queue timeouts are task time too)."""

    def preemption_overhead_s(self, task_id: str, placed_ms: int) -> float:
        """Task seconds a placement that preempted other tasks waits before it starts (context save, disk
        remount), recorded in its alloc event (`delay_s`). A real backend spends that time for real: 0."""
        return 0.0


@dataclass(frozen=True, slots=True)
class Span:
    """A duration in task seconds: fixed (lo == hi) or uniform in [lo, hi]."""

    lo: float
    hi: float

    @staticmethod
    def parse(text: str | float, field: str) -> Span:
        """"2" or "1-10" (seconds, >= 0); ValidationError naming `field` otherwise."""
        raw = str(text).strip()
        lo_s, sep, hi_s = raw.partition("-") if not raw.startswith("-") else (raw, "", "")
        try:
            lo = float(lo_s)
            hi = float(hi_s) if sep else lo
        except ValueError:
            raise ValidationError(field, "must be seconds, a number or a range LO-HI (e.g. 1-10)", raw) from None
        if not (math.isfinite(lo) and math.isfinite(hi)) or lo < 0 or hi < lo:
            raise ValidationError(field, "must be finite seconds >= 0, a range LO-HI with LO <= HI", raw)
        return Span(lo, hi)

    def draw(self, rng: random.Random) -> float:
        return self.lo if self.hi == self.lo else rng.uniform(self.lo, self.hi)

    def __str__(self) -> str:
        return f"{self.lo:g}" if self.hi == self.lo else f"{self.lo:g}-{self.hi:g}"


# paper 001 §3.1 (task seconds)
PAPER_SCHEDULING_DELAY = Span(0.4, 1.0)
PAPER_CONTAINER_START = Span(1.0, 10.0)
PAPER_PREEMPTION_OVERHEAD = Span(5.0, 25.0)


@dataclass(frozen=True)
class Overheads:
    scheduling_delay: Span = PAPER_SCHEDULING_DELAY
    container_start: Span = PAPER_CONTAINER_START
    preemption: Span = PAPER_PREEMPTION_OVERHEAD


def placement_rng(seed: int, task_id: str, placed_ms: int, what: str) -> random.Random:
    """The generator of one placement's draws: the same in every process (str seeds hash with SHA-512)."""
    return random.Random(f"{seed}|{task_id}|{placed_ms}|{what}")


@dataclass(frozen=True, slots=True)
class Plan:
    """One placement's simulated course, in unix ms."""

    start_ms: int
    end_ms: int | None  # None: runs until released
    ok: bool = True


class SimulatedExecutor(Executor):
    def __init__(self, time_factor: float = 1.0, overheads: Overheads | None = None,
                 fail_probability: float = 0.0, seed: int = 0) -> None:
        if not math.isfinite(time_factor) or time_factor <= 0:
            raise ValidationError("time_factor", "must be a finite number > 0 (task seconds per wall second)",
                                  time_factor)
        if not 0.0 <= fail_probability <= 1.0:
            raise ValidationError("fail_probability", "must be in 0..1", fail_probability)
        self._time_factor = float(time_factor)
        self.overheads = overheads or Overheads()
        self.fail_probability = fail_probability
        self.seed = seed
        self._sink: ReportSink | None = None
        self._timers: dict[str, asyncio.TimerHandle] = {}

    @property
    def time_factor(self) -> float:
        return self._time_factor

    def wall_ms(self, task_s: float) -> int:
        """Task seconds as wall milliseconds."""
        return round(task_s * 1000 / self._time_factor)

    def plan(self, task_id: str, clock: TaskClock) -> Plan:
        """The placement's start and end (deterministic in seed, task and placement time)."""
        o = self.overheads
        rng = placement_rng(self.seed, task_id, clock.placed_ms, "start")
        start = clock.started_ms or clock.placed_ms + self.wall_ms(o.scheduling_delay.draw(rng)
                                                                   + o.container_start.draw(rng) + clock.delay_s)
        if clock.runtime_s <= 0:
            return Plan(start, None)
        rng = placement_rng(self.seed, task_id, clock.placed_ms, "fail")
        fails = rng.random() < self.fail_probability
        runtime_s = clock.runtime_s * (rng.random() if fails else 1.0)
        return Plan(start, start + self.wall_ms(runtime_s), not fails)

    def preemption_overhead_s(self, task_id: str, placed_ms: int) -> float:
        return self.overheads.preemption.draw(placement_rng(self.seed, task_id, placed_ms, "preemption"))

    def attach(self, sink: ReportSink) -> None:
        self._sink = sink

    def launch(self, task_id: str, parts: tuple[Part, ...], clock: TaskClock) -> None:
        self.stop(task_id)
        plan = self.plan(task_id, clock)
        if not clock.started_ms:
            self._at(task_id, plan.start_ms, Report("run", task_id, clock.placed_ms, plan.start_ms),
                     then=lambda: self._finish_later(task_id, clock, plan))
        else:
            self._finish_later(task_id, clock, plan)

    def _finish_later(self, task_id: str, clock: TaskClock, plan: Plan) -> None:
        if plan.end_ms is None:
            self._timers.pop(task_id, None)
            return
        reason = "" if plan.ok else f"simulated failure (fail probability {self.fail_probability:g})"
        self._at(task_id, plan.end_ms, Report("done", task_id, clock.placed_ms, plan.end_ms, plan.ok, reason,
                                              plan.start_ms))

    def _at(self, task_id: str, at_ms: int, report: Report, then: Callable[[], None] | None = None) -> None:
        loop = asyncio.get_running_loop()

        def fire() -> None:
            self._timers.pop(task_id, None)
            if self._sink is not None:
                self._sink(report)
            if then is not None:
                then()

        self._timers[task_id] = loop.call_later(max(0.0, at_ms / 1000 - time.time()), fire)

    def stop(self, task_id: str) -> None:
        timer = self._timers.pop(task_id, None)
        if timer is not None:
            timer.cancel()

    def stop_all(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()

    @property
    def tasks(self) -> int:
        """Tasks with a report still to come."""
        return len(self._timers)
