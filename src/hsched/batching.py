"""Batch streams: concurrent calls to one peer coalesced into batches sent over one long-lived gRPC stream
(client side), and answered item by item (server side).

Why: in this stack a gRPC call costs far more in grpc.aio's per-call machinery and the process wake-ups it
causes than in the handler itself (a placer decides a Place in ~0.2 ms, bench/engine_cpu.py). Two things cut
that cost, both measured by bench/batch_transport.py:
- batching: the gateway has many Submits in flight at once; sending their selector and placer calls together
  pays the per-message cost once per batch and lets the placer decide the batch together (one ledger
  append). It is group commit, as the task stream's writes: a call that finds no batch on the way goes out at
  once (an idle stack answers as fast as with unary calls); otherwise it joins the next batch, sent as soon
  as the previous one is answered, so batches grow only with the load;
- one stream per peer instead of one RPC per batch: a message on an open bidirectional stream costs a
  fraction of a new unary call (no call set-up, headers or per-call task on either side), which matters most
  at moderate load, where batches are small.

Each call keeps its own deadline, outcome and trace: the server answers every call in its own item — a
result or a `BatchItemError` with the status the unary call would have had — and the client raises that
status as the `grpc.aio.AioRpcError` a unary call would have raised. A call whose deadline passes gets
DEADLINE_EXCEEDED then, whether it is still queued (it is never sent) or on the way (its answer, if it comes,
is dropped). The peer learns each call's deadline from the call itself (`deadline_field`): a placer decides
nothing for a Place after it, and the gateway releases one it may have committed before (services/gateway).
A broken stream fails the calls it carried with its status, and the next batch opens a new one.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import grpc
from opentelemetry.trace import TracerProvider

from hsched.cancel import cancel_and_wait
from hsched.domain.limits import check_message
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


def _expire(future: asyncio.Future) -> None:
    if not future.done():
        future.set_exception(rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded"))


class Coalescer(Generic[Req, Resp]):
    """Coalesces concurrent calls of one method to one peer into batches on one stream, one batch in flight.

    `batch_stream` is the batch method of a stub (`PlacerStub.PlaceBatch`), a bidirectional stream whose
    request messages have a repeated `calls` field of `Req` and whose replies have a repeated `results` field,
    one item per call with a `response` (`Resp`) or an `error` (`BatchItemError`). `method` names the single
    call ("hsched.v1.Placer/Place") in traces. `deadline_field`, if given, is an int64 field of `Req` that is
    set to the call's deadline in Unix ms, so the peer can tell a call whose caller has given up.
    """

    def __init__(self, batch_stream: Callable[..., Any], batch_request: Callable[..., Any], method: str,
                 max_batch: int = 128, wait_for_ready: bool = False,
                 tracer_provider: TracerProvider | None = None, deadline_field: str | None = None) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        self._open = batch_stream
        self._batch_request = batch_request
        self._tracing = BatchedCalls(method, tracer_provider)
        self.max_batch = max_batch
        self.wait_for_ready = wait_for_ready
        self.deadline_field = deadline_field
        self._queue: list[_Waiting] = []
        self._stream: Any = None  # the open grpc.aio.StreamStreamCall, or None
        self._sender: asyncio.Task | None = None
        self.batches = 0  # batches sent, and the calls they carried: calls / batches is the mean batch size
        self.calls = 0

    async def call(self, request: Req, timeout: float) -> Resp:
        """One call, answered as if it were sent alone; `request.trace_context` is filled in here."""
        loop = asyncio.get_running_loop()
        with self._tracing.client(request.trace_context):  # type: ignore[attr-defined]
            waiting = _Waiting(request, loop.create_future(), loop.time() + timeout)
            if self.deadline_field:
                setattr(request, self.deadline_field, int((time.time() + timeout) * 1000))
            self._queue.append(waiting)
            if self._sender is None:
                # The sender runs in an empty context: a batch belongs to no single caller's trace.
                self._sender = asyncio.create_task(self._send_queued(), context=contextvars.Context())
            timer = loop.call_at(waiting.deadline, _expire, waiting.future)
            try:
                return await waiting.future
            finally:
                timer.cancel()

    async def _send_queued(self) -> None:
        try:
            while self._queue:
                batch, self._queue = self._queue[:self.max_batch], self._queue[self.max_batch:]
                await self._send(batch)
        finally:
            self._sender = None

    async def _send(self, batch: list[_Waiting]) -> None:
        live = [w for w in batch if not w.future.done()]  # expired or cancelled while queued: never sent
        if not live:
            return
        self.batches += 1
        self.calls += len(live)
        try:
            async with asyncio.timeout_at(max(w.deadline for w in live)):  # every caller has given up by then
                reply = await self._exchange(self._batch_request(calls=[w.request for w in live]))
            if len(reply.results) != len(live):
                raise rpc_error(grpc.StatusCode.INTERNAL, f"batch of {len(live)} calls answered with "
                                f"{len(reply.results)} results")
        except BaseException as exc:
            error = await self._drop_stream(exc)
            for w in live:
                if not w.future.done():
                    w.future.set_exception(error)
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

    async def _exchange(self, batch_request: Any) -> Any:
        if self._stream is None or self._stream.done():  # none yet, or it ended while idle (the peer restarted)
            self._stream = self._open(wait_for_ready=self.wait_for_ready)
        try:
            await self._stream.write(batch_request)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            # The stream was ending as this batch went out (a peer restart): it was not sent, so it goes on a new
            # stream, which, like a unary call, waits for the peer (wait_for_ready) or fails fast with its status.
            self._stream.cancel()
            self._stream = self._open(wait_for_ready=self.wait_for_ready)
            await self._stream.write(batch_request)
        reply = await self._stream.read()
        if reply is grpc.aio.EOF:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, "the peer ended the batch stream")
        return reply

    async def _drop_stream(self, exc: BaseException) -> grpc.aio.AioRpcError:
        """Cancel the stream after a failed exchange (the next batch opens a new one); the error its calls get."""
        stream, self._stream = self._stream, None
        if isinstance(exc, grpc.aio.AioRpcError):
            error = exc
        elif isinstance(exc, TimeoutError):
            error = rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
        elif isinstance(exc, Exception) and stream is not None and stream.done():  # a write on an ended stream
            code = await stream.code()
            error = rpc_error(grpc.StatusCode.UNAVAILABLE if code == grpc.StatusCode.OK else code,
                              await stream.details() or repr(exc))
        else:
            error = rpc_error(grpc.StatusCode.CANCELLED, f"batch not answered: {exc!r}")
        if stream is not None:
            stream.cancel()
        return error

    async def close(self) -> None:
        await cancel_and_wait([self._sender])
        if self._stream is not None:
            self._stream.cancel()
            self._stream = None


async def serve_batch(calls: Sequence[Req], handle: Callable[[Req], Awaitable[Resp]], tracing: BatchedCalls,
                      item: Callable[..., Any]) -> list[Any]:
    """Answer each call of a batch with `handle` — all at once, so the service can decide them together —
    as `item(response=...)` or `item(error=BatchItemError)` in the calls' order, each in its caller's trace
    (`tracing`: `BatchedCalls` of the single call's method)."""

    async def one(call: Req) -> Any:
        with tracing.server(call.trace_context) as status:  # type: ignore[attr-defined]
            try:
                check_message(call)  # the batch's deserializer checked only its size, not each call's fields
                return item(response=await handle(call))
            except Exception as exc:  # noqa: BLE001 - status_of maps it (and logs the unexpected)
                status[:] = status_of(exc, tracing.name)
                return item(error=common_pb2.BatchItemError(code=status[0].value[0], message=status[1]))

    return list(await asyncio.gather(*(one(c) for c in calls)))
