"""Batch RPCs: concurrent calls to one peer coalesced into one RPC (client side), and answered item by item
(server side).

Why: in this stack a gRPC call costs far more in grpc.aio's per-call machinery and the process wake-ups it
causes than in the handler itself (a placer decides a Place in ~0.2 ms, bench/engine_cpu.py, of the ~1.4 ms
of CPU a Place cost it under load with unary calls, bench/stack_bench.py). The gateway has many Submits in flight at once; sending their selector
and placer calls as one RPC per peer pays that cost once per batch, and lets the placer decide the batch
together (one ledger append). It is group commit, as the task stream's writes: a call that finds fewer than
`max_inflight` batches on the way goes out at once (an idle stack answers as fast as with unary calls);
otherwise it joins the next batch, sent as soon as one returns, so batches grow only with the load.

Each call keeps its own deadline, outcome and trace: the server answers every call in its own item — a
result or a `BatchItemError` with the status the unary call would have had — and the client raises that
status as the `grpc.aio.AioRpcError` a unary call would have raised.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import grpc
from opentelemetry.trace import TracerProvider

from hsched.rpc import status_of
from hsched.telemetry import BatchedCalls
from hsched.v1 import common_pb2

Req = TypeVar("Req")
Resp = TypeVar("Resp")
_STATUS = {code.value[0]: code for code in grpc.StatusCode}


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


@dataclass
class _Waiting:
    request: Any
    future: asyncio.Future
    deadline: float  # loop time


class Coalescer(Generic[Req, Resp]):
    """Coalesces concurrent calls of one method to one peer into batch RPCs.

    `batch_rpc` is the batch method of a stub (`PlacerStub.PlaceBatch`); its request has a repeated `calls`
    field of `Req` and its reply a repeated `results` field, one item per call with a `response` (`Resp`) or
    an `error` (`BatchItemError`). `method` names the single call ("hsched.v1.Placer/Place") in traces.
    """

    def __init__(self, batch_rpc: Callable[..., Awaitable[Any]], batch_request: Callable[..., Any], method: str,
                 max_batch: int = 128, max_inflight: int = 1, wait_for_ready: bool = False,
                 tracer_provider: TracerProvider | None = None) -> None:
        if max_batch < 1 or max_inflight < 1:
            raise ValueError("max_batch and max_inflight must be >= 1")
        self._rpc = batch_rpc
        self._batch_request = batch_request
        self._tracing = BatchedCalls(method, tracer_provider)
        self.max_batch = max_batch
        self.max_inflight = max_inflight
        self.wait_for_ready = wait_for_ready
        self._queue: list[_Waiting] = []
        self._inflight = 0
        self._senders: set[asyncio.Task] = set()
        self.batches = 0  # RPCs sent, and calls they carried: calls / batches is the mean batch size
        self.calls = 0

    async def call(self, request: Req, timeout: float) -> Resp:
        """One call, answered as if it were sent alone; `request.trace_context` is filled in here."""
        loop = asyncio.get_running_loop()
        with self._tracing.client(request.trace_context):  # type: ignore[attr-defined]
            waiting = _Waiting(request, loop.create_future(), loop.time() + timeout)
            self._queue.append(waiting)
            self._send_what_fits()
            return await waiting.future

    def _send_what_fits(self) -> None:
        while self._queue and self._inflight < self.max_inflight:
            batch, self._queue = self._queue[:self.max_batch], self._queue[self.max_batch:]
            self._inflight += 1
            # The batch RPC runs in an empty context: it belongs to no single caller's trace.
            sender = asyncio.create_task(self._send(batch), context=contextvars.Context())
            self._senders.add(sender)
            sender.add_done_callback(self._senders.discard)

    async def _send(self, batch: list[_Waiting]) -> None:
        try:
            now = asyncio.get_running_loop().time()
            live = []
            for w in batch:
                if w.future.done():  # the caller went away while queued
                    continue
                if w.deadline <= now:
                    w.future.set_exception(rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed while "
                                                     "waiting for the previous batch to return"))
                    continue
                live.append(w)
            if not live:
                return
            self.batches += 1
            self.calls += len(live)
            try:
                reply = await self._rpc(self._batch_request(calls=[w.request for w in live]),
                                        timeout=min(w.deadline for w in live) - now,
                                        wait_for_ready=self.wait_for_ready)
                if len(reply.results) != len(live):
                    raise rpc_error(grpc.StatusCode.INTERNAL, f"batch of {len(live)} calls answered with "
                                    f"{len(reply.results)} results")
            except BaseException as exc:
                for w in live:
                    if not w.future.done():
                        w.future.set_exception(exc)
                if not isinstance(exc, Exception):
                    raise
                return
            for w, item in zip(live, reply.results, strict=True):
                if w.future.done():
                    continue
                if item.WhichOneof("result") == "response":
                    w.future.set_result(item.response)
                else:
                    w.future.set_exception(rpc_error(_STATUS.get(item.error.code, grpc.StatusCode.UNKNOWN),
                                                     item.error.message))
        finally:
            self._inflight -= 1
            self._send_what_fits()

    async def close(self) -> None:
        for sender in list(self._senders):
            sender.cancel()
        await asyncio.gather(*self._senders, return_exceptions=True)


async def serve_batch(calls: Sequence[Req], handle: Callable[[Req], Awaitable[Resp]], tracing: BatchedCalls,
                      item: Callable[..., Any]) -> list[Any]:
    """Answer each call of a batch RPC with `handle` — all at once, so the service can decide them together —
    as `item(response=...)` or `item(error=BatchItemError)` in the calls' order, each in its caller's trace
    (`tracing`: `BatchedCalls` of the single call's method)."""

    async def one(call: Req) -> Any:
        with tracing.server(call.trace_context) as status:  # type: ignore[attr-defined]
            try:
                return item(response=await handle(call))
            except Exception as exc:  # noqa: BLE001 - status_of maps it (and logs the unexpected)
                status[:] = status_of(exc, tracing.name)
                return item(error=common_pb2.BatchItemError(code=status[0].value[0], message=status[1]))

    return list(await asyncio.gather(*(one(c) for c in calls)))
