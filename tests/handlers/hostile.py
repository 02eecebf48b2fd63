"""Handlers whose errors, results, numbers, forks, signals and threads the supervisor must survive."""
import asyncio
import functools
import os
import signal
import sys
import threading
import time

import supervisor

UNSTORABLE = "nul \x00 and a lone \udc80 surrogate"


@supervisor.job("unstorable_error")
def unstorable_error(ctx, payload):
    raise ValueError(f"{UNSTORABLE} on attempt {ctx.job.attempt}")


@supervisor.job("deep_result")
def deep_result(ctx, payload):
    result = {}
    for _ in range(int(payload["depth"]) - 1):
        result = {"a": result}
    return result


# -- numbers, exceptions and results the child must still describe -------------------------

class Unprintable:
    def __str__(self):
        raise RuntimeError("no str")


@supervisor.job("odd_counts")
def odd_counts(ctx, payload):
    ctx.count("duplicates_suppressed", 2)  # the one sane count: it must still reach the master
    ctx.count("cache_hit", 10 ** 400)  # no float holds it
    ctx.count("whatever", 10 ** 5000)  # past the 4,300 digits int() turns into text
    ctx.count("cache_miss", float("inf"))
    ctx.metrics[Unprintable()] = 1
    return {"ok": True}


class Throttled(supervisor.RetryLater):
    """Takes the server's Retry-After as it came, never calling RetryLater.__init__."""

    def __init__(self, after):
        Exception.__init__(self, "throttled")
        self.delay = after


class Busy(supervisor.RetryLater):
    def __init__(self):
        Exception.__init__(self, "busy")  # no .delay at all


@supervisor.job("throttled")
def throttled(ctx, payload):
    after = payload["after"]
    raise Throttled(10 ** after["exp"] if isinstance(after, dict) else after)


@supervisor.job("busy")
def busy(ctx, payload):
    raise Busy()


class StrExits(Exception):
    def __str__(self):
        raise SystemExit("from __str__")


class StrInterrupts(Exception):
    def __str__(self):
        raise KeyboardInterrupt


@supervisor.job("str_exits")
def str_exits(ctx, payload):
    raise StrExits()


@supervisor.job("str_interrupts")
def str_interrupts(ctx, payload):
    raise StrInterrupts()


class Shifty(dict):
    """A result that passes the child's check, then holds what no frame can carry when it is sent."""

    def items(self):
        self.seen = getattr(self, "seen", 0) + 1
        # The child's check reads it twice (its keys, then its encoding); the send, a third time.
        return super().items() if self.seen <= 2 else [("n", 10 ** 5000)]


@supervisor.job("shifty_result")
def shifty_result(ctx, payload):
    return Shifty(n=1)


# -- processes and signals a job leaves behind -------------------------------------------

@supervisor.job("realtime_signal")
def realtime_signal(ctx, payload):
    """Ends its child with a real-time signal (their default action ends the process), which no
    ``signal.Signals`` member names."""
    os.kill(os.getpid(), signal.SIGRTMIN + int(payload.get("plus", 6)))
    time.sleep(5)


@supervisor.job("fork_and_wait")
def fork_and_wait(ctx, payload):
    """Forks the usual way; the forked process ends as payload["end"] says, the handler waits for it."""
    pid = os.fork()
    if pid == 0:
        with open(payload["marker"], "a") as f:
            f.write(f"forked {ctx.job.id}\n")
        if payload["end"] == "exit":
            sys.exit(int(payload.get("code", 0)))
        if payload["end"] == "raise":
            raise ValueError("in the forked process")
        return {"from": "the forked process"}  # "return"
    _, status = os.waitpid(pid, 0)
    return {"exit_code": os.waitstatus_to_exitcode(status)}


@supervisor.job("block_signals")
def block_signals(ctx, payload):
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM, signal.SIGUSR1})  # and never unblocks them
    return {"pid": os.getpid()}


@supervisor.job("own_signal_handlers")
def own_signal_handlers(ctx, payload):
    signal.signal(signal.SIGALRM, lambda *_: None)  # an old timeout helper's, left in place
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    return {"pid": os.getpid()}


def _flush_forever():
    while True:  # a batch flusher that commits under critical(), as the toolkit does
        with supervisor.critical():
            time.sleep(0.05)


@supervisor.job("start_flusher")
def start_flusher(ctx, payload):
    threading.Thread(target=_flush_forever, daemon=True).start()
    return {"pid": os.getpid()}


@supervisor.job("sleeper", soft_timeout=0.5, timeout=60)
def sleeper(ctx, payload):
    """Sleeps well past its soft timeout unless JobTimeout cuts it short."""
    time.sleep(float(payload.get("seconds", 5)))
    return {"slept": True}


@supervisor.job("napper", timeout=120)
def napper(ctx, payload):
    """No soft timeout: only a cancel cuts its sleep short."""
    with open(payload["marker"], "a") as f:
        f.write(f"started {ctx.job.id}\n")
    try:
        time.sleep(float(payload.get("seconds", 30)))
    except supervisor.Cancelled:
        with open(payload["marker"], "a") as f:
            f.write("saw Cancelled\n")
        raise
    return {"slept": True}


@supervisor.job("leave_alarm")
def leave_alarm(ctx, payload):
    signal.setitimer(signal.ITIMER_REAL, float(payload.get("seconds", 0.3)))  # set, never cancelled
    return {"pid": os.getpid()}


@supervisor.job("start_reporter")
def start_reporter(ctx, payload):
    """Leaves a thread sending progress frames as fast as it can, for ``seconds``."""
    def report(until=time.monotonic() + float(payload.get("seconds", 8))):
        while time.monotonic() < until:
            ctx.progress(1.0, "n" * 200)  # 1.0 always leaves the child: no throttle
    threading.Thread(target=report, daemon=True).start()
    return {"pid": os.getpid()}


@supervisor.job("big_result")
def big_result(ctx, payload):
    return {"blob": "b" * int(payload["size"])}


# -- async handlers: their timeouts, their cancels, what they leave running ------------------

async def _nap(ctx, payload):
    """Waits on the event loop (the usual place of an async handler) unless cut short; the
    marker says what reached the coroutine."""
    with open(payload["marker"], "a") as f:
        f.write(f"started {ctx.job.id}\n")
    try:
        await asyncio.sleep(float(payload.get("seconds", 30)))
    except (supervisor.JobTimeout, supervisor.Cancelled) as exc:
        with open(payload["marker"], "a") as f:
            f.write(f"saw {type(exc).__name__}\n")
        raise
    return {"slept": True}


@supervisor.job("async_sleeper", soft_timeout=0.5, timeout=60)
async def async_sleeper(ctx, payload):
    return await _nap(ctx, payload)


@supervisor.job("async_napper", timeout=120)
async def async_napper(ctx, payload):
    return await _nap(ctx, payload)


@supervisor.job("async_stubborn", timeout=4)
async def async_stubborn(ctx, payload):
    """Returns at once, leaving a task that swallows its cancel (a retry loop's bare except)."""
    async def keep_going():
        while True:
            try:
                await asyncio.sleep(0.05)
            except BaseException:  # noqa: BLE001 - the handler bug under test
                pass
    asyncio.get_running_loop().create_task(keep_going())
    await asyncio.sleep(0)
    return {"pid": os.getpid()}


def _traced(fn):
    """A plain decorator (a tracer's, a logger's): sync, it returns what the function returns."""
    @functools.wraps(fn)
    def wrapper(ctx, payload):
        return fn(ctx, payload)
    return wrapper


@supervisor.job("async_decorated")
@_traced
async def async_decorated(ctx, payload):
    with open(payload["marker"], "a") as f:
        f.write(f"ran {ctx.job.id}\n")
    await asyncio.sleep(0)
    return {"pid": os.getpid()}


# -- a transaction cut as its block ends ----------------------------------------------------

def _ring_as_the_block_ends(sig):
    """Rings ``sig`` as ``ctx.transaction()``'s ``__exit__`` starts: a soft timeout or a cancel that
    lands between the block's last statement and its commit (a race, made certain here)."""
    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_name == "__exit__" \
                and frame.f_code.co_filename.endswith(os.path.join("toolkit", "transaction.py")):
            sys.setprofile(None)
            os.kill(os.getpid(), sig)
    sys.setprofile(profile)


@supervisor.job("tx_cut_as_it_ends", soft_timeout=60)
def tx_cut_as_it_ends(ctx, payload):
    try:
        with ctx.transaction() as tx:
            tx.execute("CREATE TABLE IF NOT EXISTS effects (job TEXT)")
            tx.execute("INSERT INTO effects VALUES (%s)", (ctx.job.id,))
            _ring_as_the_block_ends(signal.SIGALRM)
    finally:
        sys.setprofile(None)


@supervisor.job("tx_effects")
def tx_effects(ctx, payload):
    with ctx.transaction() as tx:
        tx.execute("CREATE TABLE IF NOT EXISTS effects (job TEXT)")
        return {"jobs": [row["job"] for row in tx.fetchall("SELECT job FROM effects")], "pid": os.getpid()}
