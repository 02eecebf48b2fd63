"""``async def`` handlers: their event loop, with ``JobTimeout`` and ``Cancelled`` raised in the coroutine.

A signal's exception is raised wherever the main thread is. In a sync handler that is the
handler's own code; in an async one it is mostly the event loop, waiting in ``select()``
for the handler's I/O. Raised there, it ended the loop and ``asyncio.run`` cancelled the
handler instead: its ``except JobTimeout`` (or ``Cancelled``) never ran, so it could not
clean up as a sync handler does. So while the coroutine waits, a signal cancels its task,
and the task throws the ``JobTimeout`` or ``Cancelled`` into the coroutine at the await
where it waits (``_Steps``); while the coroutine's own code runs, it is raised there.

Once the handler has returned, what it left behind (tasks, async generators) is cancelled
and given ``CLEANUP_SECONDS``, and no thread of the default executor is waited for:
``asyncio.run`` waited for them all, so a task that would not end (or a ``getaddrinfo``
still blocked) held the finished job until its hard timeout, which failed it and ran it
again. Its result stands.
"""
import asyncio

from . import timeouts

CLEANUP_SECONDS = 1.0


class _Steps:
    """Drives the handler's coroutine inside its task, as ``await`` would, except that the
    task's ``CancelledError`` is swapped for the signal's exception when one is pending."""

    def __init__(self, coro):
        self.coro = coro
        self.pending = None  # the JobTimeout or Cancelled to throw in at the next await

    def __await__(self):
        value = thrown = None
        while True:
            try:
                waits_on = self.coro.send(value) if thrown is None else self.coro.throw(thrown)
            except StopIteration as stop:
                return stop.value
            value = thrown = None
            try:
                value = yield waits_on
            except BaseException as exc:  # noqa: BLE001 - what the task throws in goes on to the handler
                thrown = exc
                if isinstance(exc, asyncio.CancelledError) and self.pending is not None:
                    thrown, self.pending = self.pending, None
                    asyncio.current_task().uncancel()  # our cancel: not one the handler's asyncio.timeout counts


async def _main(steps):
    return await steps


def run(coro):
    """The result of the handler's coroutine, run on an event loop of its own (as ``asyncio.run`` would)."""
    loop = asyncio.new_event_loop()
    steps = _Steps(coro)
    try:
        asyncio.set_event_loop(loop)  # asyncio.get_event_loop() in the handler, as under asyncio.run
        task = loop.create_task(_main(steps))
        timeouts.deliver_with(lambda exc: _deliver(loop, task, steps, exc))
        try:
            return loop.run_until_complete(task)
        except asyncio.CancelledError:
            if steps.pending is not None:  # cancelled before its first step: the handler never ran
                raise steps.pending from None
            raise
        finally:
            _tidy(loop)
    finally:
        timeouts.deliver_with(None)
        steps.coro.close()  # not started (cancelled first): no "never awaited" warning
        asyncio.set_event_loop(None)
        loop.close()  # its default executor shut down without waiting


def _deliver(loop, task, steps, exc):
    """Take a signal's exception for the handler (True), or leave it to be raised where it landed (False)."""
    if task.done():
        return True  # the handler has returned: its result stands (after a SIGTERM the child leaves after it)
    if steps.coro.cr_running:
        return False  # in the handler's own code, as in a sync handler
    steps.pending = steps.pending or exc
    loop.call_soon_threadsafe(task.cancel)  # wakes the loop's select(); the task throws it into the coroutine
    # A task the handler started, running now (a CPU-bound step it never awaits out of): raised there
    # too, or it would run on and the loop would never get to the cancel.
    running = asyncio.current_task(loop)
    return running is None or running is task


def _tidy(loop):
    """Cancel what the handler left running, and wait for it ``CLEANUP_SECONDS`` at most."""
    left = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for t in left:
        t.cancel()
    if left:
        loop.run_until_complete(asyncio.wait(left, timeout=CLEANUP_SECONDS))
    loop.run_until_complete(asyncio.wait([loop.create_task(loop.shutdown_asyncgens())], timeout=CLEANUP_SECONDS))
