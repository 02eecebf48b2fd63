"""Logging: JSON lines for journald, plain text for a terminal.

Every record about a job carries its ids (``job_fields``), so one job can be
followed from claim to ack with ``grep job_01J...`` or ``jq``.
"""
import json
import logging
import sys
import time

JOB_FIELDS = ("job_id", "type", "queue", "attempt", "resource_id", "idempotency_key", "trace_id")
EVENT_FIELDS = JOB_FIELDS + ("event", "slot", "pid", "signal", "exit_code", "reason", "generation", "error",
                             "elapsed", "delay")


def job_fields(job, **extra):
    """The ``extra`` dict for a log call about ``job`` (a Job or the child's job dict)."""
    get = job.get if isinstance(job, dict) else lambda k: getattr(job, k, None)
    fields = {name: get("id" if name == "job_id" else name) for name in JOB_FIELDS}
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


def setup(level="info", fmt="auto", stream=None):
    stream = stream or sys.stderr
    if fmt == "auto":
        fmt = "text" if stream.isatty() else "json"
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
