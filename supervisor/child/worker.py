"""A child worker: one job at a time from its pipe, the handler, the reply.

The child never talks to the broker: the master claims, renews and acks. A
child only runs handlers and says how they ended, so killing one at any
instant loses nothing the master cannot account for.
"""
import collections
import ctypes
import logging
import math
import os
import select
import signal
import threading
import time
import traceback
import types

import setproctitle

from .. import protocol, schemas, toolkit, tracing
from ..model import MAX_ERROR_CLASS, MAX_ERROR_MESSAGE, MAX_ERROR_TRACEBACK, check_json, clip_end, clip_start
from ..retry import BadPayload, Permanent, RetryLater
from . import timeouts
from .context import Context
from .timeouts import Cancelled, JobTimeout

PR_SET_PDEATHSIG = 1
_pid = None  # this child's own pid (main): a process a handler forked is any other
# A thread a job started (or left behind) may send on the pipe (ctx.progress, a lock) while
# this thread replies: one frame at a time, or the master reads a torn one and kills us.
_send_lock = threading.Lock()


def title(slot, text):
    setproctitle.setproctitle(f"tangguh: worker {slot} {text}")


_clock = [None, ""]  # (whole second, its "HH:MM:SS"): strftime reads the local time zone on every call


def clock():
    now = int(time.time())
    if now != _clock[0]:
        _clock[:] = now, time.strftime("%H:%M:%S", time.localtime(now))
    return _clock[1]


def set_parent_death_signal(master_pid):
    """Die with the master: the kernel sends SIGKILL when the parent exits.

    The ``getppid`` check closes the race where the master died between
    ``fork`` and ``prctl``.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: pipe EOF and the getppid poll below still catch it
    if os.getppid() != master_pid:
        os._exit(0)


def batch_scheduling():
    """SCHED_BATCH (Linux): a child the master wakes with a job does not preempt the
    master on the spot, so the master finishes its loop turn (the other children's
    jobs, the acks) first. Same nice value and CPU share; needs no privilege."""
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except AttributeError:
        pass  # not Linux
    except OSError as exc:  # a seccomp filter or a security policy: the jobs run, the gain is lost
        logging.getLogger("tangguh.child").debug("SCHED_BATCH refused (%s): the default policy stays", exc,
                                                 extra={"event": "sched_batch_refused"})


def place(slot, cpu):
    """Pin this child to ``cpu``, the one the master chose for it (``supervisor.cpu_affinity =
    "spread"``, placement.py); None leaves it where the kernel puts it.

    Off by default: where short jobs wait on a server on this machine, the kernel wakes a
    child beside the process that answered it and both children can queue on one CPU while
    another idles; pinned, they cannot. Where one process (the master on SQLite, a local
    PostgreSQL) needs a CPU of its own, a pinned child costs it (bench/README.md).
    """
    if cpu is None:
        return
    try:
        os.sched_setaffinity(0, {cpu})
    except OSError as exc:  # a seccomp filter, a policy, the CPU gone: the jobs run where the kernel puts them
        logging.getLogger("tangguh.child").warning("cpu_affinity: pinning worker %d to CPU %d refused (%s)", slot,
                                                   cpu, exc, extra={"event": "cpu_affinity_refused", "slot": slot})


def not_ours(signum, frame):
    pass


def reset_signals():
    """Undo the master's handlers; Ctrl-C on the terminal is for the master only."""
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGQUIT, signal.SIGTTIN, signal.SIGTTOU, signal.SIGCHLD, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_DFL)
    # A reload is the master's: a SIGHUP to the whole group (`systemctl kill -s HUP`, a hangup)
    # must not end the jobs running here; Ctrl-C is the master's too. Caught, not ignored: an
    # ignored signal stays ignored in every program a job starts.
    signal.signal(signal.SIGHUP, not_ours)
    signal.signal(signal.SIGINT, not_ours)
    timeouts.install()


def main(sock, slot, handlers, master_pid, cpu=None):
    """Run in the forked child; never returns (``os._exit``).

    Exiting through ``os._exit`` also means no finalizer runs on objects
    inherited from the master: closing an inherited PostgreSQL connection
    would end the master's own session.
    """
    global _pid
    code = 0
    _pid = os.getpid()
    try:
        set_parent_death_signal(master_pid)
        batch_scheduling()
        place(slot, cpu)
        reset_signals()
        for name in ("NOTIFY_SOCKET", "WATCHDOG_PID", "WATCHDOG_USEC"):
            os.environ.pop(name, None)
        title(slot, "idle")
        send_frame(sock, protocol.encode({"op": protocol.READY, "pid": os.getpid()}))
        toolkit.attach_master(lambda msg: send_frame(sock, protocol.encode(msg)))  # ctx.lock registers its locks
        serve(sock, slot, handlers, master_pid)
    except BaseException:  # noqa: BLE001 - a child must never unwind into the master's code
        code = 1  # first: printing fails too when the job closed stderr
        traceback.print_exc()
    finally:
        os._exit(code)


def serve(sock, slot, handlers, master_pid):
    pending = collections.deque()  # the jobs of a batch not started yet
    idle = True  # what the process title says
    while True:
        if not pending and not idle:
            title(slot, "idle")  # once a batch is done, not between its jobs
            idle = True
        try:
            # Between the jobs of a batch only a glance at the pipe (a SKIP, a STOP);
            # otherwise wait for work, checking now and then that the master lives.
            ready, _, _ = select.select([sock], [], [], 0 if pending else 1.0)
            if os.getppid() != master_pid:
                return  # orphaned: nobody renews our lease any more
            msg = protocol.recv(sock) if ready else None
        except JobTimeout:
            # The master's hard-timeout SIGTERM landed after the job ended (the
            # reply crossed it): nothing to interrupt, leave quietly.
            return
        except ConnectionError:
            return  # the master died (its PR_SET_PDEATHSIG kill is on the way)
        if ready:
            if msg is None:
                return  # EOF: the master is gone
            if msg.get("op") in (protocol.STOP, protocol.SKIP):
                while pending:  # never started: the master hands them back, no attempt spent
                    send_reply(sock, protocol.skipped_reply(pending.popleft()["job"]))
                if msg.get("op") == protocol.STOP:
                    return
                continue
            if msg.get("op") == protocol.RUN:
                pending.extend(msg["batch"] if "batch" in msg else [msg])
                # Every frame already here before the next job: a top-up RUN can sit in
                # front of a SKIP, and the master has handed back what a SKIP names.
                continue
            # A CANCEL frame read here crossed the reply of the job it named: nothing to do
            # (the master asks for a SKIP first, so no job of a batch starts after it).
        if pending:
            idle = False
            entry = pending.popleft()
            if entry.get("start_by") is not None and time.monotonic() >= entry["start_by"]:
                # Its expiry passed while it waited behind the batch's jobs before it: "not
                # started by then ends expired", so not started; the master hands it back.
                send_reply(sock, protocol.skipped_reply(entry["job"]))
                continue
            if not run_one(sock, slot, handlers, entry):
                return


def run_one(sock, slot, handlers, entry):
    """Run one job and send its reply; False when the child must leave (a hard timeout's SIGTERM came)."""
    job = entry["job"]
    title(slot, f"{job['type']} {job['id']} since {clock()}")
    reply = tracing.run_span(job, lambda: run_job(job, handlers, entry.get("soft_timeout")))
    try:
        with timeouts.critical():  # a SIGTERM now waits for the whole reply: never a torn frame
            toolkit.end_job()  # a transaction the job left open: rolled back, not held while we idle
            send_reply(sock, reply)
    except JobTimeout:
        return False  # the reply is out; the master is stopping us (hard timeout crossed the reply)
    # After the hard timeout's SIGTERM the master hands back the rest of the batch and kills
    # us after kill_grace: a job started meanwhile would run here, cut off, and again elsewhere.
    return not timeouts.terminated()


def send_frame(sock, frame):
    """Send one whole frame to the master: never beside another thread's, never from a process
    a handler forked (its frames would speak for a job it does not run)."""
    if _pid is not None and os.getpid() != _pid:
        return
    with _send_lock:
        sock.sendall(frame)


def send_reply(sock, reply):
    """Send a job's reply (``reply_frame``)."""
    send_frame(sock, reply_frame(reply))


def reply_frame(reply):
    """The frame of a job's reply; one over the protocol's limit fails the job instead (``result_too_large``),
    and so does one that does not encode (``exception``, class ``UnencodableReply``). ``testing.run_jobs``
    judges its replies through this too, so a test sees what the daemon would store."""
    try:
        frame = protocol.encode(reply, limit=protocol.MAX_MESSAGE)
    except JobTimeout:
        raise  # the master's SIGTERM, not the reply's fault
    except BaseException as exc:  # noqa: BLE001 - a result's own types run code as it is encoded
        what = "result" if reply.get("ok") else f"{reply.get('error_class')} error reply"
        if isinstance(exc, protocol.TooLarge):
            kind, error_class, message = protocol.RESULT_TOO_LARGE, "ResultTooLarge", f"{what}: {exc}"
        else:
            # The result passed check_json in run_job, then changed (another thread, a mapping
            # whose items() differ each call): a failed attempt, retried like any exception.
            kind, error_class = protocol.EXCEPTION, "UnencodableReply"
            message = clip_start(f"{what} does not encode: {type(exc).__name__}: {_text(exc)}", MAX_ERROR_MESSAGE)
        frame = protocol.encode({
            "op": protocol.RESULT, "job_id": reply["job_id"], "token": reply["token"], "ok": False,
            "kind": kind, "error_class": error_class, "message": message,
            "traceback": "", "duration": reply.get("duration"), "metrics": reply.get("metrics", {})})
    return frame


def run_job(job, handlers, soft_timeout=None):
    """Run one job; return the reply for the master (never raises)."""
    started = time.monotonic()
    reply = {"op": protocol.RESULT, "job_id": job["id"], "token": job["token"]}
    spec = handlers.get(job["type"])
    if spec is None:
        return dict(reply, ok=False, kind=protocol.UNKNOWN_TYPE, error_class="UnknownType",
                    message=f"no handler for job type {job['type']!r}", traceback="", duration=0.0)
    deadline = time.time() + soft_timeout if soft_timeout else None
    ctx = Context(job, deadline)
    try:
        timeouts.arm(soft_timeout)  # a SIGTERM the last job kept blocked raises JobTimeout here
        payload = schemas.for_handler(spec, job["payload"])  # the typed payload, or BadPayload
        result = spec.fn(ctx, payload)
        # An async def's coroutine, or one a plain (sync) decorator around an async def returned: never
        # a result. Judged by the value, not spec.is_async, or it was failed unrun (BadInput, not JSON).
        if type(result) is types.CoroutineType:
            from . import aio  # asyncio: the registry loaded it with the handler; a sync-only daemon never does

            result = aio.run(result)
        if _pid is not None and os.getpid() != _pid:
            _leave_fork(None)
        timeouts.disarm()
        if result is not None:  # most handlers return nothing: no walk, no trial encoding
            check_json(result, "handler result")
        reply.update(ok=True, duration=time.monotonic() - started)
        # Only what differs from nothing: most jobs return None, count nothing and are not
        # cancelled, and each key is encoded here and decoded in the master for every job.
        if result is not None:
            reply["result"] = result
        metrics = _numbers(ctx.metrics)
        if metrics:
            reply["metrics"] = metrics
        if timeouts.cancel_requested():
            reply["cancelled"] = True  # the handler returned after its cancel reached it (the job ends cancelled)
        return reply
    except BaseException as exc:  # noqa: BLE001 - every way a handler can end is an outcome
        if _pid is not None and os.getpid() != _pid:
            _leave_fork(exc)
        timeouts.disarm()
        try:
            return _failure(reply, exc, ctx, started)
        except BaseException:  # noqa: BLE001 - the exception's own code (__class__, a log filter) failed too
            name = clip_start(type(exc).__name__, MAX_ERROR_CLASS)
            return dict(reply, ok=False, kind=protocol.EXCEPTION, error_class=name, message=f"<unprintable {name}>",
                        traceback="", duration=time.monotonic() - started, metrics={},
                        cancelled=timeouts.cancel_requested())


def _failure(reply, exc, ctx, started):
    """The reply for a handler that raised ``exc``."""
    if isinstance(exc, (KeyboardInterrupt, SystemExit)) and not isinstance(exc, JobTimeout):
        kind = protocol.EXCEPTION
    elif isinstance(exc, JobTimeout):
        kind = protocol.TIMEOUT
    elif isinstance(exc, Cancelled):
        kind = protocol.CANCELLED
    elif isinstance(exc, BadPayload):
        kind = protocol.BAD_PAYLOAD
    elif isinstance(exc, Permanent):
        kind = protocol.PERMANENT
    elif isinstance(exc, RetryLater):
        kind = protocol.RETRY_LATER
        delay = _delay(exc)
        if delay is not None:  # else the master applies the backoff
            reply["delay"] = delay
    else:
        kind = protocol.EXCEPTION
    error_class, message, trace = _error_text(exc)
    ctx.log.warning("job failed: %s: %s", error_class, message)
    return dict(reply, ok=False, kind=kind, error_class=error_class, message=message,
                traceback=trace, duration=time.monotonic() - started,
                metrics=_numbers(ctx.metrics), cancelled=timeouts.cancel_requested())


def _error_text(exc):
    """The class, message and traceback of a handler's exception, each cut to its limit.

    Cut here, before the pipe: one exception holding a response body would
    otherwise be sent, logged twice and stored in every attempt's history.
    The message keeps its start; the traceback keeps its end (where the
    handler failed), with the cut message in place of the whole one.
    """
    full = _text(exc)
    message = clip_start(full, MAX_ERROR_MESSAGE)
    trace = traceback.format_exc()
    if message is not full:
        trace = trace.replace(full, message)
    return clip_start(type(exc).__name__, MAX_ERROR_CLASS), message, clip_end(trace, MAX_ERROR_TRACEBACK)


def _text(exc):
    """``str(exc)``, or a stand-in when the exception's own ``__str__`` fails: still the handler's failure."""
    try:
        return str(exc)
    except BaseException:  # noqa: BLE001 - any failure of a handler's __str__, SystemExit too
        return f"<unprintable {type(exc).__name__}>"


def _delay(exc):
    """A ``RetryLater``'s delay as a number the master takes, or None (a subclass may set anything, or nothing)."""
    try:
        return _number(exc.delay)
    except BaseException:  # noqa: BLE001 - no delay, or a property of the handler's that fails
        return None


def _number(value):
    """``value`` as a finite int or float, or None: what a float cannot hold, or an int
    past 4,300 digits, would fail the frame or the master's arithmetic."""
    if isinstance(value, (bool, str, bytes, bytearray)):
        return None  # True is no count, and text is not parsed into one
    try:
        number = float(value)
    except BaseException:  # noqa: BLE001 - an overflow, or the __float__ of a handler's type
        return None
    if not math.isfinite(number):
        return None
    return value if type(value) is int else number  # an exact int stays one: the status counters add ints


def _numbers(counts):
    """The counter deltas that can cross the pipe: a bad key or value is dropped, never breaks the reply."""
    out = {}
    if not isinstance(counts, dict):
        return out
    try:
        for key, value in counts.items():
            value = _number(value)
            key = key if type(key) is str else _key(key)
            if value is not None and key is not None:
                out[key] = value
    except BaseException:  # noqa: BLE001 - a mapping of the handler's own that fails as it is read
        pass
    return out


def _key(key):
    try:
        return str(key)
    except BaseException:  # noqa: BLE001 - a handler's key type whose __str__ fails: dropped
        return None


def _leave_fork(exc):
    """End a process the handler forked, where its handler ended: as Python would have
    (the exit code of its ``sys.exit``, 1 and a traceback for an exception), but with no
    reply (the job is its parent's) and no flush of buffers it shares with its parent."""
    code = 1
    try:
        if exc is None or (isinstance(exc, SystemExit) and exc.code is None):
            code = 0
        elif isinstance(exc, SystemExit) and type(exc.code) is int:
            code = exc.code & 0xFF  # what the kernel keeps of it
        else:
            os.write(2, "".join(traceback.format_exception(exc)).encode(errors="replace"))
    finally:
        os._exit(code)
