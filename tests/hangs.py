"""Hangs become failures with a diagnosis: every thread's stack and every pending asyncio task's stack.

A test that waits forever would otherwise eat CI's whole time budget and print nothing about where it waits.
`conftest.py` arms `Watchdog` around each test's call; `inprocess.service` uses `dump_tasks` when a service
does not stop."""

from __future__ import annotations

import asyncio
import faulthandler
import gc
import os
import sys
import threading


def dump_tasks(loop: asyncio.AbstractEventLoop | None = None, file=None) -> None:
    """The stacks of the pending tasks of `loop` (default: every running loop in this process), walked by hand:
    Task.print_stack raises on grpc's Cython coroutines, and a dump must never fail."""
    file = file or sys.stderr
    loops = [loop] if loop else running_loops()
    for each in loops:
        for task in [t for t in list(asyncio.tasks._all_tasks) if t.get_loop() is each and not t.done()]:
            print(f"--- {task!r}", file=file)
            awaiting = task.get_coro()
            while awaiting is not None:
                frame = next((f for f in (getattr(awaiting, a, None) for a in ("cr_frame", "gi_frame", "ag_frame"))
                              if f is not None), None)
                if frame is None:
                    print(f"    awaiting {awaiting!r}", file=file)
                    break
                print(f"    {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}", file=file)
                awaiting = next((a for a in (getattr(awaiting, n, None) for n in ("cr_await", "gi_yieldfrom",
                                                                                  "ag_await")) if a is not None), None)
    file.flush()


def running_loops() -> list[asyncio.AbstractEventLoop]:
    return [o for o in gc.get_objects() if isinstance(o, asyncio.AbstractEventLoop) and o.is_running()]


class Watchdog:
    """After `after_s`: dump every stack and cancel the running loops' tasks, so the test fails (its cleanup
    runs); if it still has not returned `grace_s` later, exit the process (status 70) rather than hang."""

    def __init__(self, name: str, after_s: float, grace_s: float = 120.0) -> None:
        self.name, self.after_s, self.grace_s = name, after_s, grace_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"watchdog {name}", daemon=True)

    def __enter__(self) -> Watchdog:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()

    def _watch(self) -> None:
        if self._done.wait(self.after_s):
            return
        print(f"\n==== {self.name}: still running after {self.after_s:g} s; stacks follow ====", file=sys.stderr)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        for loop in running_loops():
            try:
                dump_tasks(loop)
            except Exception as exc:  # noqa: BLE001 - the cancel below matters more than the dump
                print(f"(dumping the tasks failed: {exc!r})", file=sys.stderr)
            for task in list(asyncio.tasks._all_tasks):
                if task.get_loop() is loop:
                    loop.call_soon_threadsafe(task.cancel)
        if self._done.wait(self.grace_s):
            return
        print(f"==== {self.name}: did not return {self.grace_s:g} s after being cancelled; exiting ====",
              file=sys.stderr)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(70)
