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
    """The stacks of the pending tasks of `loop` (default: every running loop in this process)."""
    file = file or sys.stderr
    loops = [loop] if loop else [o for o in gc.get_objects() if isinstance(o, asyncio.AbstractEventLoop)
                                 and o.is_running()]
    for each in loops:
        for task in asyncio.all_tasks(each):
            print(f"--- {task!r}", file=file)
            task.print_stack(file=file)
    file.flush()


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
        loops = [o for o in gc.get_objects() if isinstance(o, asyncio.AbstractEventLoop) and o.is_running()]
        for loop in loops:
            dump_tasks(loop)
            for task in asyncio.all_tasks(loop):
                loop.call_soon_threadsafe(task.cancel)
        if self._done.wait(self.grace_s):
            return
        print(f"==== {self.name}: did not return {self.grace_s:g} s after being cancelled; exiting ====",
              file=sys.stderr)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(70)
