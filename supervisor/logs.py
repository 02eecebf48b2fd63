"""Logging: JSON lines for journald, plain text for a terminal.

Every record about a job carries its ids (``job_fields``), so one job can be
followed from claim to ack with ``grep job_01J...`` or ``jq``.
"""
import json
import logging
import os
import sys
import time

from .tracing import log_trace_id

JOB_FIELDS = ("job_id", "type", "queue", "attempt", "resource_id", "idempotency_key", "trace_id")
EVENT_FIELDS = JOB_FIELDS + ("event", "slot", "pid", "signal", "exit_code", "reason", "by", "generation", "error",
                             "elapsed", "delay",
                             # the web console's action events: who did what to which jobs, how many
                             "user", "action", "count", "job_ids", "filter", "outcome", "queues", "schedule", "rate",
                             "dropped_types")


def job_fields(job, **extra):
    """The ``extra`` dict for a log call about ``job`` (a Job or the child's job dict)."""
    get = job.get if isinstance(job, dict) else lambda k: getattr(job, k, None)
    fields = {name: get("id" if name == "job_id" else name) for name in JOB_FIELDS}
    fields["trace_id"] = log_trace_id(fields["trace_id"])  # a traceparent logs as its trace id
    fields.update(extra)
    return fields


class JsonFormatter(logging.Formatter):
    def format(self, record):
        out = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            "process": record.process,
        }
        for name in EVENT_FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                out[name] = value
        if record.exc_info:
            out["traceback"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    def format(self, record):
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created)) + f".{int(record.msecs):03d}"
        extras = " ".join(
            f"{name}={getattr(record, name)}" for name in EVENT_FIELDS if getattr(record, name, None) is not None
        )
        line = f"{stamp} {record.levelname:<7} [{record.process}] {record.getMessage()}"
        if extras:
            line += f"  {extras}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


# syslog priorities (sd-daemon(3)): journald reads a "<N>" line prefix as the priority.
_PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}


class JournalPrefix(logging.Formatter):
    """Prefix each line with its syslog priority, so ``journalctl -p warning`` means something."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def format(self, record):
        level = _PRIORITY.get(record.levelno, 6 if record.levelno < logging.WARNING else 3)
        return f"<{level}>" + self.inner.format(record)


def to_journal(stream, env=None):
    """Whether ``stream`` is the journal: ``$JOURNAL_STREAM`` names its device and inode."""
    value = (os.environ if env is None else env).get("JOURNAL_STREAM", "")
    try:
        dev, ino = (int(x) for x in value.split(":"))
        st = os.fstat(stream.fileno())
    except (ValueError, OSError, AttributeError):
        return False
    return (st.st_dev, st.st_ino) == (dev, ino)


_ours = []  # the handler setup() made: a reload's log.format is applied to it


def setup(level="info", fmt="auto", stream=None):
    stream = stream or sys.stderr
    handler = logging.StreamHandler(stream)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    _ours[:] = [handler]
    reconfigure(level, fmt)


def reconfigure(level, fmt):
    """``[log]`` of a reloaded config: the level, and the format of setup()'s handler (one a
    handler module added is left as it is)."""
    for handler in _ours:
        stream = handler.stream
        if fmt == "auto":
            fmt = "text" if stream.isatty() else "json"
        formatter = JsonFormatter() if fmt == "json" else TextFormatter()
        handler.setFormatter(JournalPrefix(formatter) if to_journal(stream) else formatter)
    logging.getLogger().setLevel(level.upper())
