"""The gateway's side of the task lifecycle (issue 15): transitions hook, the DC ledger follower that turns
placer-initiated ledger events into task events (idempotently, resuming after a restart), Release semantics.
Real Redis, real Ledger writer, real gateway services."""

from __future__ import annotations

import asyncio

from hsched.state.keys import Keys
from hsched.state.redis import connect
from hsched.state.tasks import TaskStore, step
from hsched.state.transitions import Transitions
from hsched.v1 import common_pb2 as pb


async def test_transitions_see_every_durable_record_in_order_and_not_the_replayed_ones(redis_url, prefix):
    client = connect(redis_url)
    try:
        seen: list[tuple[str, str, int]] = []

        async def callback(task: pb.Task, kind: str) -> None:
            await asyncio.sleep(0)  # a subscriber that awaits does not reorder what follows
            seen.append((task.task_id, kind, task.state))

        store = TaskStore(client, Keys(prefix).tasks, transitions=Transitions())
        store.transitions.subscribe(callback)
        a, b = pb.Task(task_id="a"), pb.Task(task_id="b")
        await store.write(step("submitted", a), step("placed", a))
        await store.write(step("submitted", b), step("deferred", b))
        await store.transitions.drained()
        assert seen == [("a", "submitted", pb.TASK_STATE_SUBMITTED), ("a", "placed", pb.TASK_STATE_PLACED),
                        ("b", "submitted", pb.TASK_STATE_SUBMITTED), ("b", "deferred", pb.TASK_STATE_DEFERRED)]
        again = TaskStore(client, Keys(prefix).tasks, transitions=Transitions())
        again.transitions.subscribe(callback)
        assert await again.load() == 4
        await again.transitions.drained()
        assert len(seen) == 4  # a restart rebuilds its table silently
    finally:
        await client.aclose()
