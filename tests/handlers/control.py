"""Handlers for the job-control process tests (cancel, progress, pause). Evidence goes to marker files."""
import os
import time

import supervisor


def _mark(payload, text):
    if payload.get("marker"):
        with open(payload["marker"], "a") as f:
            f.write(text + "\n")


def _burn(n=20_000):
    """Pure-Python work: the interpreter runs bytecode all along (no sleep, no C call to wait in)."""
    total = 0
    for i in range(n):
        total += i * i
    return total


@supervisor.job("cancel_cooperative", timeout=120)
def cancel_cooperative(ctx, payload):
    """Inside critical() Cancelled is held back, so the loop itself asks ctx.cancelled()."""
    _mark(payload, f"started {ctx.job.id} {os.getpid()}")
    with supervisor.critical():
        while not ctx.cancelled():
            _burn()
        _mark(payload, "saw ctx.cancelled()")
    return {"stopped": "cooperatively"}  # not reached: Cancelled is raised on leaving critical()


def _until_cancelled(ctx, payload, seen):
    """A CPU-bound loop that never looks: Cancelled is raised into it (and marked ``seen``)."""
    _mark(payload, f"started {ctx.job.id} {os.getpid()}")
    try:
        while True:
            _burn()
    except supervisor.Cancelled:
        _mark(payload, seen)
        raise


@supervisor.job("cancel_ignored", timeout=120)
def cancel_ignored(ctx, payload):
    _until_cancelled(ctx, payload, "saw Cancelled")


@supervisor.job("cancel_swallowed", timeout=120)
def cancel_swallowed(ctx, payload):
    """Catches Cancelled and returns as if done: the job still ends cancelled (the child says
    the cancel reached it), never done."""
    try:
        _until_cancelled(ctx, payload, "swallowed Cancelled")
    except supervisor.Cancelled:
        return {"finished": True}


@supervisor.job("cancel_stuck", timeout=120)
def cancel_stuck(ctx, payload):
    """Inside critical() for longer than cancel_grace, never asking: only the kill stops it."""
    _mark(payload, f"started {ctx.job.id} {os.getpid()}")
    deadline = time.monotonic() + float(payload.get("seconds", 60))
    with supervisor.critical():
        while time.monotonic() < deadline:
            _burn()
    return {"finished": True}


@supervisor.job("progressing", timeout=60)
def progressing(ctx, payload):
    """Reports progress, then waits for the ``release`` file (bounded)."""
    for i in range(1, 51):
        ctx.progress(i / 100, f"step {i} of 100")  # 50 calls at once: most are coalesced away
    time.sleep(0.3)  # past the coalescing window: the next report always leaves
    ctx.progress(0.5, "halfway")
    deadline = time.monotonic() + float(payload.get("max_wait", 30))
    while not os.path.exists(payload["release"]) and time.monotonic() < deadline:
        time.sleep(0.01)
    return {"released": True}
