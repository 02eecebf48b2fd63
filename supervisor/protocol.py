"""Messages between the master and a child: 4-byte length + JSON, over a socketpair.

The whole vocabulary is here: the message ops, the ways an attempt can fail,
and the job fields a child receives. The master, the child and the lock
helpers use these names, never the strings.
"""
import json
import math
import os
import signal
import struct

from .jsonvalues import decode

_HEADER = struct.Struct("!I")
_ENCODER = json.JSONEncoder(separators=(",", ":"))  # built once: json.dumps builds one per call with separators
MAX_MESSAGE = 64 * 1024 * 1024
TOP_UP_BYTES = 64 * 1024  # the most a message to a busy child holds (master/pool.py, Child.room)

# master -> child. A RUN carries one job, or a "batch" of several the child runs
# in order, answering each; SKIP: answer the jobs not started yet "skipped".
# CANCEL ({"job_id", "by", "reason"}) is followed by CANCEL_SIGNAL:
# a busy handler reads no pipe, so the signal is what raises ``Cancelled`` in it
# (child/timeouts.py); the frame itself is read, and ignored, once the job is over.
RUN, STOP, SKIP, CANCEL = "run", "stop", "skip", "cancel"
CANCEL_SIGNAL = signal.SIGUSR1
# child -> master. PROGRESS: {"job_id", "fraction", "note"} (ctx.progress, coalesced).
# RESULT: {"job_id", "token", "ok", "duration"}, with "result", "metrics" ({name: number}) and
# "cancelled" (true) only when set, and a failure's "kind", "error_class", "message",
# "traceback" (and a RetryLater's "delay"); "skipped": true for a job of a batch never started.
READY, RESULT, LOCK, UNLOCK, PROGRESS = "ready", "result", "lock", "unlock", "progress"
MAX_NOTE = 200  # characters of a progress note kept

# How an attempt failed: a child's reply says one of the first six ("kind");
# the master decides the rest itself. Each is also the reason stored with the
# failed attempt (model.REASONS), except RETRY_LATER, stored as EXCEPTION.
EXCEPTION, PERMANENT, BAD_PAYLOAD, RETRY_LATER, TIMEOUT, RESULT_TOO_LARGE = (
    "exception", "permanent", "bad_payload", "retry_later", "timeout", "result_too_large")
CRASHED, UNKNOWN_TYPE = "crashed", "unknown_type"
LEASE_EXPIRED = "lease_expired"  # the broker's claim took back the attempt's lease (master: not run again)
CANCELLED = "cancelled"  # the handler raised ``Cancelled`` (the attempt ends the job ``cancelled``)

# Why the master kills a child.
KILLED_TIMEOUT, KILLED_LEASE_LOST, KILLED_SHUTDOWN, KILLED_BAD_FRAME = "timeout", "lease_lost", "shutdown", "bad_frame"
KILLED_CANCEL = "cancel"  # still running ``cancel_grace`` after its cancel

# The job fields a child receives in a RUN message (``max_attempts`` is the
# effective one, after config overrides).
JOB_FIELDS = ("id", "type", "queue", "payload", "attempt", "max_attempts", "resource_id", "idempotency_key",
              "trace_id", "token", "parents")


def run_message(job, max_attempts, soft_timeout, start_by=None):
    """The RUN message that hands ``job`` to a child (the fields of ``JOB_FIELDS``); ``start_by``:
    the instant (``time.monotonic()``, one clock for the whole host) past which the child must not
    start it (its expiry), but answer it "skipped"."""
    fields = {"id": job.id, "type": job.type, "queue": job.queue, "payload": job.payload, "attempt": job.attempt,
              "max_attempts": max_attempts, "resource_id": job.resource_id,
              "idempotency_key": job.idempotency_key, "trace_id": job.trace_id, "token": job.token}
    if job.parents is not None:  # a job without dependencies: nothing to carry
        fields["parents"] = job.parents
    message = {"op": RUN, "soft_timeout": soft_timeout, "job": fields}
    if start_by is not None:
        message["start_by"] = start_by
    return message


def run_frame(batch, start_by=None):
    """The framed RUN message of ``batch``: a list of (job, registry.JobSettings); ``start_by``:
    job id -> its start-by instant (``run_message``), for the jobs that have one."""
    start_by = start_by or {}
    return encode(batch_message([run_message(j, s.max_attempts, s.soft_timeout, start_by.get(j.id))
                                 for j, s in batch]))


def batch_message(entries):
    """One RUN message for several jobs: ``entries`` are ``run_message`` dicts, run in order."""
    if len(entries) == 1:
        return entries[0]
    for entry in entries:  # each made for this message: its "op" goes, the rest ("start_by" too) stays
        del entry["op"]
    return {"op": RUN, "batch": entries}


def skipped_reply(job):
    """A child's answer for a job of its batch it did not start (the master asked it to skip)."""
    return {"op": RESULT, "job_id": job["id"], "token": job["token"], "skipped": True}


class TooLarge(ValueError):
    """A message over ``MAX_MESSAGE`` bytes."""


def finite(value):
    """``value`` when it is a number a float holds (not a bool, not inf or NaN), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return value if math.isfinite(value) else None
    except OverflowError:  # an int past a float's range: 10**400
        return None


def clean_result(msg):
    """A child's RESULT with what the master computes with made safe: ``duration`` and
    ``delay`` dropped unless ``finite``, ``metrics`` kept only as {name: finite number}, the
    error's texts dropped unless strings.

    A handler's values travel in it (a count, a ``RetryLater`` delay), and a handler may even
    write to the pipe itself: nothing in a reply may raise in the master's loop.
    """
    for key in ("duration", "delay"):
        if key in msg and finite(msg[key]) is None:
            del msg[key]
    for key in ("kind", "error_class", "message", "traceback"):
        if key in msg and not isinstance(msg[key], str):
            del msg[key]
    deltas = msg.get("metrics")
    if deltas is not None:
        msg["metrics"] = {k: v for k, v in deltas.items() if isinstance(k, str) and finite(v) is not None} \
            if isinstance(deltas, dict) else None
    return msg


def encode(obj, limit=None):
    """The frame of ``obj``; ``TooLarge`` if its body is over ``limit`` bytes (when given)."""
    body = _ENCODER.encode(obj).encode()
    if limit is not None and len(body) > limit:
        raise TooLarge(f"message of {len(body)} bytes is over the {limit} byte limit")
    return _HEADER.pack(len(body)) + body


def send(sock, obj):
    write_frame(sock, encode(obj))


def write_frame(sock, frame):
    """``sock.sendall(frame)`` without its first system call when the frame fits at once.

    The master's sockets to its children have a timeout (a child that stops reading
    costs a send at most that long), and with one every send polls before it writes.
    A frame the socket's buffer takes whole, the usual case, is one ``write``; the
    rest of one it does not goes through ``sendall``, timeout and all.
    """
    try:
        sent = os.write(sock.fileno(), frame)
    except BlockingIOError:
        sent = 0
    if sent < len(frame):
        sock.sendall(memoryview(frame)[sent:])


def recv(sock):
    """Blocking read of one message; None at EOF."""
    header = _read_exactly(sock, _HEADER.size)
    if header is None:
        return None
    (size,) = _HEADER.unpack(header)
    body = _read_exactly(sock, size)
    if body is None:
        return None
    return decode(body.decode())


def _read_exactly(sock, n):
    chunks = bytearray()
    while len(chunks) < n:
        chunk = sock.recv(n - len(chunks))
        if not chunk:
            return None
        chunks += chunk
    return bytes(chunks)


class Reader:
    """Incremental decoder for the master's non-blocking side."""

    def __init__(self):
        self.buffer = bytearray()

    def feed(self, data):
        """(the whole messages in the bytes so far, the error of a frame it cannot take or None).

        A frame over the limit, a body that is no JSON, a message without an op: the
        reading ends there, and the messages before it came whole, each to be acted on
        (the replies of jobs a child finished before its next job wrote into the pipe).
        """
        self.buffer += data
        messages = []
        try:
            while len(self.buffer) >= _HEADER.size:
                (size,) = _HEADER.unpack_from(self.buffer)
                if size > MAX_MESSAGE:
                    raise TooLarge(f"message of {size} bytes is over the {MAX_MESSAGE} byte limit")
                if len(self.buffer) < _HEADER.size + size:
                    break
                body = self.buffer[_HEADER.size:_HEADER.size + size].decode()
                del self.buffer[:_HEADER.size + size]
                msg = decode(body)
                if not (isinstance(msg, dict) and isinstance(msg.get("op"), str)):
                    raise ValueError("a message without an op")
                messages.append(msg)
        except (ValueError, RecursionError) as exc:
            self.buffer = bytearray()
            return messages, exc
        return messages, None
