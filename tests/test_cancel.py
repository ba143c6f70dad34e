"""hsched.cancel.cancel_and_wait: shutdown stops a task even when it absorbs a cancel."""

from __future__ import annotations

import asyncio

from hsched.cancel import cancel_and_wait


async def test_a_task_that_absorbs_cancels_is_cancelled_again_until_it_ends():
    absorbed = 0

    async def stubborn() -> None:  # like a retry loop around a client that turned a cancel into an error
        nonlocal absorbed
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if absorbed == 2:
                    raise
                absorbed += 1
                asyncio.current_task().uncancel()

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    await asyncio.wait_for(cancel_and_wait([task], retry_s=0.01), timeout=30)
    assert task.cancelled() and absorbed == 2


async def test_finished_tasks_and_none_are_skipped_and_a_plain_task_needs_one_cancel():
    done = asyncio.create_task(asyncio.sleep(0, result="ok"))
    await done
    sleeper = asyncio.create_task(asyncio.sleep(3600))
    await asyncio.sleep(0)
    await asyncio.wait_for(cancel_and_wait([None, done, sleeper], retry_s=60), timeout=30)  # one round
    assert done.result() == "ok" and sleeper.cancelled()
