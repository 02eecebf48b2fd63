"""Handlers for the effect tests: the invoice example with a crash at a chosen instant.

The real ``handlers/invoices.py`` is copied beside this file; it is loaded by
path here so these wrappers run its exact code. Every wrapper appends a line
to ``payload["marker"]`` (``<event> <attempt> <pid> <time> ...``) and, on the
attempts after the first, waits for ``payload["release"]`` (if given) before
running, so a test can look at the world between the crash and the re-run.
"""
import contextlib
import importlib.util
import os
import signal
import time

import supervisor

_spec = importlib.util.spec_from_file_location("tangguh_test_invoices",
                                               os.path.join(os.path.dirname(__file__), "invoices.py"))
invoices = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(invoices)


def _mark(payload, *words):
    with open(payload["marker"], "a") as f:
        f.write(" ".join(str(w) for w in words) + "\n")


def _die(payload, ctx, where):
    _mark(payload, "dying", ctx.job.attempt, os.getpid(), time.time(), where)
    os.kill(os.getpid(), signal.SIGKILL)


def _gate(ctx, payload):
    _mark(payload, "started", ctx.job.attempt, os.getpid(), time.time())
    if ctx.job.attempt > 1 and payload.get("release"):
        deadline = time.monotonic() + 30
        while not os.path.exists(payload["release"]) and time.monotonic() < deadline:
            time.sleep(0.01)


@supervisor.job("recalc_crash", timeout=60)
def recalc_crash(ctx, payload):
    """``recalculate_invoice``; on attempt 1 SIGKILLs itself at ``payload["crash"]``:

    * ``after_commit``: after the handler returned (committed, cache
      invalidated), before the reply: the master never acks that attempt;
    * ``before_invalidation``: in the first after-commit step, so the commit
      is durable and the cache invalidation has not run.
    """
    _gate(ctx, payload)
    crash = payload["crash"] if ctx.job.attempt == 1 else None
    if crash == "before_invalidation":
        opened = ctx.transaction

        @contextlib.contextmanager
        def transaction():
            with opened() as tx:
                tx.after_commit(lambda: _die(payload, ctx, crash))  # first in line
                yield tx

        ctx.transaction = transaction
    result = invoices.recalculate_invoice(ctx, payload)
    _mark(payload, "done", ctx.job.attempt, os.getpid(), time.time(), result["total"])
    if crash == "after_commit":
        _die(payload, ctx, crash)
    return result


@supervisor.job("hold_lock", timeout=60)
def hold_lock(ctx, payload):
    """Take Redis lock ``payload["name"]`` (TTL ``ttl``); on attempt 1 hold it until killed."""
    _gate(ctx, payload)
    t0 = time.monotonic()
    with ctx.lock(payload["name"], ttl=float(payload.get("ttl", 60)), wait=float(payload.get("wait", 30))) as lock:
        waited = time.monotonic() - t0
        _mark(payload, "acquired", ctx.job.attempt, os.getpid(), time.time(), lock.fence, f"{waited:.3f}", lock.key)
        if ctx.job.attempt == 1:
            deadline = time.monotonic() + 50
            while time.monotonic() < deadline:  # the test SIGKILLs us here
                time.sleep(0.05)
    return {"fence": lock.fence, "waited": waited}


@supervisor.job("lock_then_exit")
def lock_then_exit(ctx, payload):
    """Attempt 1 takes lock ``payload["name"]``, waits for file ``payload["go"]`` and dies holding it."""
    if ctx.job.attempt > 1:
        return {}
    lock = ctx.lock(payload["name"], ttl=60, wait=5)
    _mark(payload, "acquired", ctx.job.attempt, os.getpid(), time.time(), lock.fence, lock.key)
    deadline = time.monotonic() + 30
    while not os.path.exists(payload["go"]) and time.monotonic() < deadline:
        time.sleep(0.01)
    os._exit(3)


@supervisor.job("leak_lock")
def leak_lock(ctx, payload):
    """Takes a lock and returns without releasing it (a handler bug the master cleans up)."""
    lock = ctx.lock(payload["name"], ttl=60, wait=1)
    return {"key": lock.key, "fence": lock.fence}


@supervisor.job("fill_cache", timeout=60)
def fill_cache(ctx, payload):
    """Reads ``payload["key"]`` through ``ctx.cache``; on attempt 1 its builder holds the fill
    lease until the test SIGKILLs the child."""
    def build():
        _mark(payload, "building", ctx.job.attempt, os.getpid())
        deadline = time.monotonic() + 50
        while ctx.job.attempt == 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        return {"built_by": ctx.job.attempt}

    return ctx.cache.get_or_build(payload["key"], build, ttl=600)
