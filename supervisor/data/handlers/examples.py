"""Example handlers: one of each kind the supervisor must cope with.

``tangguh config init`` puts this file in a new handlers folder, so the README's
walk-through (``tangguh enqueue hash_chain --payload '{"rounds": 100000}'``) runs
at once; ``tangguh demo`` uses it too. A handler is a function ``fn(ctx, payload)``
marked with ``@supervisor.job("type")``; what it returns is stored as the job's
result, what it raises decides a retry (``Transient``, any exception) or the dead
letters (``Permanent``). Every ``*.py`` here is loaded by path: add your own
modules beside this one (and delete it when you no longer want the examples),
then ``systemctl reload tangguh`` (SIGHUP) to load them.
"""
import hashlib
import os
import time

import supervisor


@supervisor.job("hash_chain", timeout=60)
def hash_chain(ctx, payload):
    """CPU-bound: hash a seed ``rounds`` times (pure Python work, no I/O)."""
    digest = str(payload.get("seed", "tangguh")).encode()
    for _ in range(int(payload.get("rounds", 100_000))):
        digest = hashlib.sha256(digest).digest()
    return {"digest": digest.hex()}


@supervisor.job("sleep", timeout=60)
def sleep(ctx, payload):
    """Waits ``seconds``; touches ``marker`` first, if given, so a test knows it started."""
    if payload.get("marker"):
        with open(payload["marker"], "a") as f:
            f.write(f"{ctx.job.id} {os.getpid()} {ctx.job.attempt}\n")
    time.sleep(float(payload.get("seconds", 1)))
    return {"slept": payload.get("seconds", 1)}


@supervisor.job("flaky", max_attempts=5)
def flaky(ctx, payload):
    """Fails its first ``failures`` attempts with a transient error, then succeeds."""
    if ctx.job.attempt <= int(payload.get("failures", 2)):
        raise supervisor.Transient(f"attempt {ctx.job.attempt} failed on purpose")
    return {"succeeded_on_attempt": ctx.job.attempt}


@supervisor.job("always_permanent")
def always_permanent(ctx, payload):
    """Never succeeds: dead-lettered after one attempt."""
    raise supervisor.Permanent(payload.get("why", "this job can never succeed"))
