"""``async def`` handlers: their event loop, and what they leave on it.

Once the handler has returned, what it left behind (tasks, async generators) is cancelled
and given ``CLEANUP_SECONDS``, and no thread of the default executor is waited for:
``asyncio.run`` waited for them all, so a task that would not end (or a ``getaddrinfo``
still blocked) held the finished job until its hard timeout, which failed it and ran it
again. Its result stands.
"""
import asyncio

CLEANUP_SECONDS = 1.0


def run(fn, ctx, payload):
    """``fn(ctx, payload)``'s result, run on an event loop of its own (as ``asyncio.run`` would)."""
    loop = asyncio.new_event_loop()
    try:
        asyncio.set_event_loop(loop)  # asyncio.get_event_loop() in the handler, as under asyncio.run
        task = loop.create_task(fn(ctx, payload))
        try:
            return loop.run_until_complete(task)
        finally:
            _tidy(loop)
    finally:
        asyncio.set_event_loop(None)
        loop.close()  # its default executor shut down without waiting


def _tidy(loop):
    """Cancel what the handler left running, and wait for it ``CLEANUP_SECONDS`` at most."""
    left = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for t in left:
        t.cancel()
    if left:
        loop.run_until_complete(asyncio.wait(left, timeout=CLEANUP_SECONDS))
    loop.run_until_complete(asyncio.wait([loop.create_task(loop.shutdown_asyncgens())], timeout=CLEANUP_SECONDS))
