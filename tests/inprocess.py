"""A service of services/ run in the test's own event loop (its real `serve`), on a real port."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any


@asynccontextmanager
async def service(server: Any, argv: list[str], port_file: Path) -> AsyncIterator[str]:
    """`server.serve(server.parser().parse_args(argv + --port-file))` until the block ends; yields its address."""
    args = server.parser().parse_args([*argv, "--port-file", str(port_file)])
    stop = asyncio.Event()
    task = asyncio.create_task(server.serve(args, stop))
    for _ in range(200):
        if port_file.exists() or task.done():
            break
        await asyncio.sleep(0.05)
    assert port_file.exists(), task.exception() if task.done() else f"{server.__name__} did not start"
    try:
        yield f"127.0.0.1:{port_file.read_text()}"
    finally:
        stop.set()
        await task
