"""Handlers for the process tests. Each one leaves evidence in files the test reads."""
import os
import signal
import time

import supervisor


def _mark(payload, text):
    if payload.get("marker"):
        with open(payload["marker"], "a") as f:
            f.write(text + "\n")


@supervisor.job("noop")
def noop(ctx, payload):
    _mark(payload, f"{ctx.job.id} {os.getpid()} {ctx.job.attempt}")
    return {"attempt": ctx.job.attempt}


@supervisor.job("hold")
def hold(ctx, payload):
    """Marks that it started, then waits for the ``release`` file (bounded)."""
    _mark(payload, f"started {ctx.job.id} {os.getpid()} {ctx.job.attempt}")
    deadline = time.monotonic() + float(payload.get("max_wait", 30))
    while not os.path.exists(payload["release"]) and time.monotonic() < deadline:
        time.sleep(0.01)
    _mark(payload, f"finished {ctx.job.id}")
    return {"released": os.path.exists(payload["release"])}


@supervisor.job("spin")
def spin(ctx, payload):
    """Never returns by itself: a pure-Python endless loop (hard timeout test)."""
    _mark(payload, f"started {ctx.job.id} {os.getpid()}")
    while True:
        pass


@supervisor.job("soft_timeout", soft_timeout=0.3, timeout=10)
def soft_timeout(ctx, payload):
    _mark(payload, f"started {ctx.job.id} deadline={ctx.deadline is not None}")
    try:
        time.sleep(5)
    except supervisor.JobTimeout:
        _mark(payload, "saw JobTimeout")
        raise
    return {"late": True}


@supervisor.job("poison")
def poison(ctx, payload):
    _mark(payload, f"{ctx.job.attempt} {time.time()}")
    raise ValueError(f"poison attempt {ctx.job.attempt}")


@supervisor.job("follow_up")
def follow_up(ctx, payload):
    """Enqueue the next job through the handler object, with no client configured anywhere."""
    return {"next": noop.enqueue({"after": ctx.job.id})}


@supervisor.job("permanent")
def permanent(ctx, payload):
    _mark(payload, f"{ctx.job.attempt}")
    raise supervisor.Permanent("never")


@supervisor.job("suicide")
def suicide(ctx, payload):
    """Kills its own child process: a crash the master must absorb."""
    _mark(payload, f"{ctx.job.id} {os.getpid()} {ctx.job.attempt}")
    if ctx.job.attempt <= int(payload.get("crashes", 1)):
        os.kill(os.getpid(), signal.SIGKILL)
    return {"survived_on": ctx.job.attempt}


@supervisor.job("metered")
def metered(ctx, payload):
    """Reports the toolkit counter deltas in ``payload["metrics"]`` as the toolkit would (``ctx.count``)."""
    for name, amount in payload.get("metrics", {}).items():
        ctx.count(name, amount)
    if payload.get("fail"):
        raise supervisor.Permanent("metered failure")
    return {}


@supervisor.job("effect_once")
def effect_once(ctx, payload):
    """An effect guarded by an idempotency key; attempt 1 dies after the commit, before the reply."""
    with ctx.transaction() as tx:
        rec = ctx.idempotency.begin(tx, payload["key"])
        if not rec.done:
            _mark(payload, f"effect {ctx.job.attempt}")
            rec.complete({"done_on": ctx.job.attempt})
    if ctx.job.attempt == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # the master never hears of the commit: the job runs again
    return {"duplicate": rec.done}


@supervisor.job("huge_result")
def huge_result(ctx, payload):
    """A result over the 64 MiB message limit (protocol.MAX_MESSAGE)."""
    return {"blob": "x" * (64 * 1024 * 1024 + 1)}


@supervisor.job("oversize_frame")
def oversize_frame(ctx, payload):
    """A child gone wrong: writes a frame header over the limit straight into its pipe, then hangs."""
    import struct

    from supervisor import protocol
    from supervisor.toolkit import connections

    sock = connections._notify.__closure__[0].cell_contents  # the child's end of the pipe to the master
    _mark(payload, f"sending {os.getpid()}")  # first: the master may kill us as soon as the header lands
    sock.sendall(struct.pack("!I", protocol.MAX_MESSAGE + 1) + b"x" * 1024)
    time.sleep(60)


class _Unprintable(ValueError):
    def __str__(self):
        raise RuntimeError("no text for you")


@supervisor.job("unprintable")
def unprintable(ctx, payload):
    """Raises an exception whose ``str()`` itself raises."""
    raise _Unprintable()


@supervisor.job("nap")
def nap(ctx, payload):
    """Runs ``seconds`` (default 30), or until the ``release`` file exists: a long job type."""
    _mark(payload, f"started {ctx.job.id} {os.getpid()} {ctx.job.attempt}")
    deadline = time.monotonic() + float(payload.get("seconds", 30))
    release = payload.get("release")
    while time.monotonic() < deadline and not (release and os.path.exists(release)):
        time.sleep(0.01)
    _mark(payload, f"finished {ctx.job.id}")


@supervisor.job("quick")
def quick(ctx, payload):
    """A short job (batched once measured), ``pause`` seconds long; on its first attempt it can
    die (``die``), write a frame header over the limit into its pipe and hang (``garbage``),
    never return (``spin``) or wait for the ``release`` file (bounded)."""
    _mark(payload, f"started {ctx.job.id} {os.getpid()} {ctx.job.attempt}")
    time.sleep(payload.get("pause", 0))
    if ctx.job.attempt == 1:
        if payload.get("die"):
            os.kill(os.getpid(), signal.SIGKILL)
        if payload.get("garbage"):
            oversize_frame(ctx, payload)
        while payload.get("spin"):
            pass
        deadline = time.monotonic() + 30
        while payload.get("release") and not os.path.exists(payload["release"]) and time.monotonic() < deadline:
            time.sleep(0.01)
    _mark(payload, f"finished {ctx.job.id}")


@supervisor.job("huge_error")
def huge_error(ctx, payload):
    """Raises with a message of ``size`` characters (a response body in an exception), and
    with a cause whose message is ``cause_size`` characters when given."""
    if payload.get("cause_size"):
        try:
            raise KeyError("y" * int(payload["cause_size"]))
        except KeyError as cause:
            raise ValueError("head-of-message " + "x" * int(payload["size"])) from cause
    raise ValueError("head-of-message " + "x" * int(payload["size"]) + " tail-of-message")


@supervisor.job("signals")
def signals(ctx, payload):
    """``spoil``: change what the next job on this child would run under (SIGPIPE to the default,
    as command-line tools do, SIGCHLD ignored, a SIGHUP handler of its own); else report it."""
    import subprocess

    if payload.get("spoil"):
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        signal.signal(signal.SIGCHLD, signal.SIG_IGN)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        return {"pid": os.getpid()}
    return {"pid": os.getpid(), "pipe": signal.getsignal(signal.SIGPIPE).name,
            "hup_ignored": signal.getsignal(signal.SIGHUP) == signal.SIG_IGN,
            "false_exits": subprocess.run(["false"]).returncode}


@supervisor.job("std_fds")
def std_fds(ctx, payload):
    """``spoil``: close stdin, stdout and stderr (a daemonising idiom); else report which of them
    are open and that a line can be printed and logged."""
    if payload.get("all"):  # its pipe to the master too: the child cannot even say what went wrong
        os.closerange(0, 1024)
        return {"pid": os.getpid()}
    if payload.get("spoil"):
        for fd in (0, 1, 2):
            os.close(fd)
        return {"pid": os.getpid()}
    opened = [fd for fd in (0, 1, 2) if _is_open(fd)]
    print("std_fds prints", flush=True)
    ctx.log.warning("std_fds logs")
    return {"pid": os.getpid(), "open": opened}


def _is_open(fd):
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True
