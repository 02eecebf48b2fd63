"""Handlers for the workflow process tests. Each leaves evidence in a marker file the test reads."""
import os
import time

import supervisor


def _mark(payload, text):
    with open(payload["marker"], "a") as f:
        f.write(text + "\n")


@supervisor.job("flow_add")
def flow_add(ctx, payload):
    """A chain step: its payload's number plus the previous step's result (0 for the first)."""
    previous = ctx.parent_result() if ctx.parents() else 0
    _mark(payload, f"step {ctx.job.id} {previous}")
    return previous + payload["n"]


@supervisor.job("flow_member")
def flow_member(ctx, payload):
    """A group member: waits for the ``release`` file (bounded), fails for good while ``fail_until`` is missing."""
    _mark(payload, f"member {ctx.job.id} {os.getpid()}")
    deadline = time.monotonic() + 30
    while payload.get("release") and not os.path.exists(payload["release"]) and time.monotonic() < deadline:
        time.sleep(0.01)
    if payload.get("fail_until") and not os.path.exists(payload["fail_until"]):
        raise supervisor.Permanent("not yet")
    return payload["i"]


@supervisor.job("flow_callback")
def flow_callback(ctx, payload):
    """The fan-in: records that it ran (the effect that must happen once) and what it saw."""
    parents = ctx.parents()
    states = sorted({state for state, _ in parents.values()})
    _mark(payload, f"callback {ctx.job.id} {len(parents)} {','.join(states)} {sum(r for _, r in parents.values())}")
    return len(parents)
