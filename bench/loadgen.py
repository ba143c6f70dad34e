"""Closed- and open-loop gRPC load generator, spread over spawned client processes.

Each client process runs its own uvloop event loop. Two entry points:

* ``run_load(target, make_request, ...)`` -- one unary call per iteration through generic
  ``channel.unary_unary`` callables, so it works with any service. ``make_request(i)`` returns
  ``(method_path, request, response_deserializer)``; ``request`` is ``bytes`` (sent as is) or a
  protobuf message; a ``None`` deserializer returns raw bytes.
* ``run_closed_loop(step_factory, args, ...)`` -- "sequence" mode: each iteration runs a coroutine
  that makes several calls, timed per name. ``step_factory`` (a ``"module:function"`` string or
  an importable top-level function) is called in every client process as ``step_factory(*args)``
  and must return an async context manager yielding ``async def step(i, call)``::

      @contextlib.asynccontextmanager
      async def submit_release(target):
          async with grpc.aio.insecure_channel(target) as channel:
              stub = SchedulerStub(channel)

              async def step(i, call):
                  lease = await call("Submit", stub.Submit(make_task(i), timeout=5))
                  await call("Release", stub.Release(ReleaseRequest(id=lease.id), timeout=5))

              yield step

  ``await call(name, awaitable)`` times the awaitable, records latency or error code under
  ``name`` and returns its result (re-raising errors, which end the iteration). A step may also
  return samples it timed itself: a list of ``(name, latency_s, ok)``, ``ok`` a bool or an
  error-code string. The whole iteration is recorded under ``STEP``.

Both take ``rate_rps`` for open-loop load: arrivals at ``rate_rps`` (Poisson or fixed interval),
at most ``concurrency`` in flight; arrivals finding that many in flight are dropped and counted
in ``LoadResult.dropped``. Without ``rate_rps`` the load is closed-loop: ``concurrency`` workers
each run iterations back to back. Runs are bounded by ``duration_s`` and/or ``total`` (measured
iterations), after ``warmup_s`` of unrecorded load. ``i`` is unique across processes.

These functions block (they wait for child processes): call them from synchronous code or via
``asyncio.to_thread``.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import itertools
import multiprocessing as mp
import random
import time
from array import array
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

STEP = "(step)"
_SETUP_TIMEOUT_S = 60.0
_DRAIN_TIMEOUT_S = 15.0


@dataclass
class LoadResult:
    calls: int  # completed calls, successful or not
    errors: dict[str, int]  # status code name (or exception class) -> count
    elapsed_s: float
    throughput_rps: float  # successful calls per second
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    dropped: int = 0  # open loop: arrivals dropped because `concurrency` calls were in flight
    offered_rps: float | None = None  # open loop: target arrival rate
    client_cpu: list[float] = field(default_factory=list)  # busy fraction of each client process
    extra: dict[str, Any] = field(default_factory=dict)
    latencies_s: Any = field(default=None, repr=False)  # the successful calls' latencies (for `combine`)

    @classmethod
    def from_samples(cls, latencies_s, errors: dict[str, int], elapsed_s: float, **kw) -> LoadResult:
        """Latency percentiles are over successful calls only."""
        import numpy as np

        lat = np.asarray(latencies_s, dtype=float) * 1e3
        p50, p90, p99, mx = np.percentile(lat, [50, 90, 99, 100]) if lat.size else [float("nan")] * 4
        return cls(
            calls=int(lat.size) + sum(errors.values()),
            errors=dict(errors),
            elapsed_s=elapsed_s,
            throughput_rps=lat.size / elapsed_s if elapsed_s > 0 else 0.0,
            p50_ms=float(p50), p90_ms=float(p90), p99_ms=float(p99), max_ms=float(mx),
            latencies_s=lat / 1e3,
            **kw,
        )

    @classmethod
    def combine(cls, results: list[LoadResult]) -> LoadResult:
        """Runs one after the other as one: their calls over the sum of their measured times."""
        import numpy as np

        errors: Counter = Counter()
        for r in results:
            errors.update(r.errors)
        lat = np.concatenate([np.asarray(r.latencies_s if r.latencies_s is not None else [], dtype=float)
                              for r in results]) if results else []
        cpu = [sum(r.client_cpu[k] * r.elapsed_s for r in results if k < len(r.client_cpu))
               / max(1e-9, sum(r.elapsed_s for r in results)) for k in range(max((len(r.client_cpu) for r in results),
                                                                                  default=0))]
        return cls.from_samples(lat, errors, sum(r.elapsed_s for r in results),
                                dropped=sum(r.dropped for r in results), client_cpu=cpu)

    def summary(self) -> str:
        s = (f"{self.throughput_rps:8.0f} req/s  p50 {self.p50_ms:6.2f}  p90 {self.p90_ms:6.2f}  "
             f"p99 {self.p99_ms:6.2f}  max {self.max_ms:7.2f} ms  calls {self.calls}")
        if self.offered_rps is not None:
            s += f"  offered {self.offered_rps:.0f}/s  dropped {self.dropped}"
        if self.client_cpu:
            s += f"  client CPU {'/'.join(f'{c:.0%}' for c in self.client_cpu)}"
        return s + (f"  errors {self.errors}" if self.errors else "")


@dataclass
class _Spec:
    factory: Any  # "module:function" or importable callable
    args: tuple
    concurrency: int  # closed loop: workers; open loop: max in flight
    duration_s: float | None
    total: int | None
    warmup_s: float
    rate_rps: float | None
    arrival: str
    uvloop: bool


def resolve(ref):
    """'package.module:function' -> the function (callables are returned unchanged)."""
    if callable(ref):
        return ref
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


def _split(n: float | None, parts: int, k: int):
    if n is None:
        return None
    if isinstance(n, float):
        return n / parts
    return n // parts + (1 if k < n % parts else 0)


def run_closed_loop(
    step_factory: str | Callable,
    args: tuple = (),
    concurrency: int = 16,
    duration_s: float | None = 5.0,
    total: int | None = None,
    processes: int = 1,
    warmup_s: float = 0.5,
    rate_rps: float | None = None,
    arrival: str = "poisson",
    uvloop: bool = True,
) -> dict[str, LoadResult]:
    """Run `step_factory(*args)`'s step in `processes` spawned processes; per-name results.

    Despite the name, `rate_rps` turns it into open-loop load (see module docstring).
    """
    if duration_s is None and total is None:
        raise ValueError("bound the run: give duration_s and/or total")
    if arrival not in ("poisson", "fixed"):
        raise ValueError("arrival must be 'poisson' or 'fixed'")
    processes = max(1, min(processes, concurrency, total or concurrency))
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(processes)
    children = []
    for k in range(processes):
        rate = _split(float(rate_rps), processes, k) if rate_rps else None
        spec = _Spec(step_factory, tuple(args), _split(concurrency, processes, k), duration_s,
                     _split(total, processes, k), warmup_s, rate, arrival, uvloop)
        parent_end, child_end = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_child_main, args=(k, processes, spec, barrier, child_end), daemon=True)
        proc.start()
        child_end.close()
        children.append((proc, parent_end))

    budget = _SETUP_TIMEOUT_S + warmup_s + (duration_s or 600.0) + _DRAIN_TIMEOUT_S + 10
    deadline = time.monotonic() + budget
    reports = []
    try:
        for proc, conn in children:
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"load generator process {proc.pid} gave no result in {budget:.0f} s")
            try:
                report = conn.recv()
            except EOFError:
                raise RuntimeError(f"load generator process {proc.pid} died (exit {proc.exitcode})") from None
            if isinstance(report, BaseException):
                raise report
            reports.append(report)
    finally:
        for proc, _ in children:
            proc.join(5)
            if proc.is_alive():
                proc.terminate()
                proc.join()
    return _merge(reports, rate_rps)


def _merge(reports: list[dict], rate_rps: float | None) -> dict[str, LoadResult]:
    elapsed = max(r["elapsed_s"] for r in reports)
    dropped = sum(r["dropped"] for r in reports)
    names = sorted({n for r in reports for n in r["lat"]} | {n for r in reports for n in r["err"]})
    out = {}
    for name in names:
        lat = array("d")
        err: Counter = Counter()
        for r in reports:
            lat.extend(r["lat"].get(name, ()))
            err.update(r["err"].get(name, {}))
        out[name] = LoadResult.from_samples(lat, err, elapsed, dropped=dropped, offered_rps=rate_rps,
                                            client_cpu=[r["cpu"] for r in reports])
    return out


def run_load(
    target: str,
    make_request: str | Callable[[int], tuple[str, Any, Callable | None]],
    concurrency: int = 16,
    duration_s: float | None = 5.0,
    total: int | None = None,
    processes: int = 1,
    warmup_s: float = 0.5,
    rate_rps: float | None = None,
    arrival: str = "poisson",
    channels: int = 1,
    timeout_s: float = 10.0,
    uvloop: bool = True,
) -> LoadResult:
    """Unary load on `target`: all methods returned by `make_request` merged into one result.

    `make_request` is a "module:function" string or a top-level (picklable) function.
    `channels` is the number of channels (TCP connections) per client process.
    """
    results = run_closed_loop(unary_step, (target, make_request, channels, timeout_s), concurrency,
                              duration_s, total, processes, warmup_s, rate_rps, arrival, uvloop)
    step = results.get(STEP) or LoadResult.from_samples([], {}, 0.0, offered_rps=rate_rps)
    per_method = {k: v for k, v in results.items() if k != STEP}
    step.extra["per_method"] = per_method
    return step


@contextlib.asynccontextmanager
async def unary_step(target: str, make_request, channels: int = 1, timeout_s: float = 10.0):
    """Step factory used by `run_load`: one generic unary call per iteration."""
    import grpc

    make = resolve(make_request)
    # A local subchannel pool gives each channel its own connection.
    chans = [grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
             for _ in range(channels)]
    try:
        await asyncio.wait_for(asyncio.gather(*(c.channel_ready() for c in chans)), 10)
        stubs: dict[tuple, Callable] = {}

        async def step(i, call):
            method, request, deserializer = make(i)
            ch = i % channels
            key = (ch, method, deserializer, type(request))
            mc = stubs.get(key)
            if mc is None:
                serializer = None if isinstance(request, bytes) else type(request).SerializeToString
                mc = stubs[key] = chans[ch].unary_unary(
                    method, request_serializer=serializer, response_deserializer=deserializer)
            return await call(method, mc(request, timeout=timeout_s))

        yield step
    finally:
        for c in chans:
            await c.close()


class _Recorder:
    def __init__(self):
        self.lat: dict[str, array] = {}
        self.err: dict[str, Counter] = {}
        self.window_start = float("inf")  # samples are kept for calls started at or after this
        self.last_end = 0.0

    def add(self, name: str, t0: float, t1: float, code: str | None):
        if t0 < self.window_start:
            return
        self.last_end = max(self.last_end, t1)
        if code is None:
            self.lat.setdefault(name, array("d")).append(t1 - t0)
        else:
            self.err.setdefault(name, Counter())[code] += 1

    async def call(self, name: str, awaitable):
        t0 = time.perf_counter()
        try:
            result = await awaitable
        except BaseException as e:
            self.add(name, t0, time.perf_counter(), _code(e))
            raise
        self.add(name, t0, time.perf_counter(), None)
        return result

    async def iteration(self, step, i: int):
        t0 = time.perf_counter()
        try:
            own = await step(i, self.call)
        except BaseException as e:
            self.add(STEP, t0, time.perf_counter(), _code(e))
            if isinstance(e, asyncio.CancelledError):
                raise
            return
        t1 = time.perf_counter()
        self.add(STEP, t0, t1, None)
        for name, latency, ok in own if isinstance(own, list) else ():
            code = None if ok is True else ("ERROR" if ok is False else str(ok))
            self.add(name, t0, t0 + latency, code)


def _code(e: BaseException) -> str:
    code = getattr(e, "code", None)
    if callable(code):
        with contextlib.suppress(Exception):
            return code().name
    return type(e).__name__


def _child_main(k: int, n: int, spec: _Spec, barrier, conn):
    try:
        if spec.uvloop:
            import uvloop

            runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
        else:
            runner = asyncio.Runner()
        with runner:
            report = runner.run(_drive(k, n, spec, barrier))
    except Exception as e:  # noqa: BLE001 - any failure is counted as an error of that call
        barrier.abort()
        report = RuntimeError(f"load generator process {k}: {type(e).__name__}: {e}")
    conn.send(report)
    conn.close()


async def _drive(k: int, n: int, spec: _Spec, barrier) -> dict:
    rec = _Recorder()
    seq = itertools.count()

    def next_i() -> int:  # unique across processes
        return next(seq) * n + k

    async with resolve(spec.factory)(*spec.args) as step:
        await asyncio.to_thread(barrier.wait, _SETUP_TIMEOUT_S)
        start, cpu0 = time.perf_counter(), time.process_time()
        rec.window_start = start + spec.warmup_s
        end = rec.window_start + spec.duration_s if spec.duration_s is not None else float("inf")
        if spec.rate_rps:
            dropped = await _open_loop(step, rec, spec, end, next_i)
        else:
            dropped = 0
            await _closed_loop(step, rec, spec, end, next_i)
    now = time.perf_counter()
    cpu = (time.process_time() - cpu0) / (now - start)
    measured_end = rec.last_end if rec.last_end > rec.window_start else now
    return {"lat": rec.lat, "err": {name: dict(c) for name, c in rec.err.items()},
            "elapsed_s": measured_end - rec.window_start, "dropped": dropped, "cpu": cpu}


async def _closed_loop(step, rec: _Recorder, spec: _Spec, end: float, next_i):
    measured = 0

    async def worker():
        nonlocal measured
        while True:
            now = time.perf_counter()
            if now >= end or (spec.total is not None and measured >= spec.total):
                return
            if now >= rec.window_start:
                measured += 1
            await rec.iteration(step, next_i())

    workers = [asyncio.create_task(worker()) for _ in range(spec.concurrency)]
    # workers stop on their own at `end`; only then does the drain timeout apply to calls still in flight
    _, running = await asyncio.wait(workers, timeout=max(0.0, end - time.perf_counter()))
    await _drain(list(running))


async def _open_loop(step, rec: _Recorder, spec: _Spec, end: float, next_i) -> int:
    rng = random.Random()
    interval = 1.0 / spec.rate_rps
    in_flight: set[asyncio.Task] = set()
    arrivals = dropped = 0
    t = time.perf_counter()
    while True:
        t += rng.expovariate(spec.rate_rps) if spec.arrival == "poisson" else interval
        if t >= end or (spec.total is not None and arrivals >= spec.total):
            break
        delay = t - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if t >= rec.window_start:
            arrivals += 1
        if len(in_flight) >= spec.concurrency:
            dropped += t >= rec.window_start
            continue
        task = asyncio.create_task(rec.iteration(step, next_i()))
        in_flight.add(task)
        task.add_done_callback(in_flight.discard)
    await _drain(list(in_flight))
    return dropped


async def _drain(tasks: list[asyncio.Task]):
    if not tasks:
        return
    _, pending = await asyncio.wait(tasks, timeout=_DRAIN_TIMEOUT_S)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
