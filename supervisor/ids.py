"""Job ids and trace ids, made at enqueue: the model's ``NewJob.validate`` makes one of each per job."""
import os
import time
import uuid

_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"


def new_job_id(now=None):
    """A sortable id: ``job_`` + 48-bit milliseconds + 80 random bits, ULID-style.

    Sorting ids sorts jobs by creation time, which gives brokers a stable
    tie-breaker for "oldest first".
    """
    return job_id_from(time.time() if now is None else now, os.urandom(10))


def job_id_from(now, noise):
    """``new_job_id`` of a time (seconds) and 10 random bytes."""
    n = ((int(now * 1000) << 80) | int.from_bytes(noise, "big")) & _ID_BITS
    # 130 bits (48 + 80 used) are 26 digits, two per 10-bit table entry: the digit loop costs more
    # than the rest of an enqueue's checks.
    p = _PAIRS
    return ("job_" + p[n >> 120] + p[n >> 110 & 1023] + p[n >> 100 & 1023] + p[n >> 90 & 1023]
            + p[n >> 80 & 1023] + p[n >> 70 & 1023] + p[n >> 60 & 1023] + p[n >> 50 & 1023] + p[n >> 40 & 1023]
            + p[n >> 30 & 1023] + p[n >> 20 & 1023] + p[n >> 10 & 1023] + p[n & 1023])


_ID_BITS = (1 << 130) - 1
_PAIRS = tuple(a + b for a in _CROCKFORD for b in _CROCKFORD)  # 10 bits -> two Crockford digits


def new_trace_id():
    return uuid.uuid4().hex


def trace_id_from(noise):
    """``uuid.UUID(bytes=noise, version=4).hex`` (what ``new_trace_id`` makes) without the object."""
    b = bytearray(noise)
    b[6] = (b[6] & 0x0F) | 0x40
    b[8] = (b[8] & 0x3F) | 0x80
    return b.hex()
