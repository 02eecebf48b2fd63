"""Test helpers for application code: run queued jobs in-process, start a real supervisor, assert on jobs.

``run_jobs`` takes each due job through the same steps a supervisor does:
the broker's claim, the child's ``run_job`` (context, toolkit, soft timeout,
payload schema), the master's verdict (retry policy, dead-lettering) and the
broker writes. Only the clock differs: the broker reads ``clock``, and when
nothing is due but a job is waiting out a retry backoff, the clock jumps to
it (or to the next token of a ``rate_limit`` that holds due jobs back), so a retry path runs
in no time. It needs a SQLite broker (the
``tangguh_broker`` fixture); a job enqueued with a ``delay`` waits for
``testing.clock.advance(seconds)``. The client's broker reads the same clock
(``on_test_clock``: the ``tangguh_client`` fixture's, and ``run_jobs``'s client), so
what a producer stamps after a skipped backoff (``delay``, ``expires_in``) counts
from the time the jobs saw, as on a daemon whose clock really moved. A hard timeout needs a real child to kill, so
test it with ``tangguh_supervisor``.

The pytest fixtures (``tangguh_config``, ``tangguh_broker``, ``tangguh_client``,
``tangguh_supervisor``) live in ``supervisor.pytest_plugin``, registered
through the ``pytest11`` entry point.
"""
import dataclasses
import json
import os
import signal
import socket
import sqlite3
import sys
import threading
import time

from . import config as config_module, jobref, protocol, registry, toolkit, tracing
from .child import worker as child
from .client import queue_list
from .jobref import default_client
from .master import verdict
from .master.outcomes import Write
from .model import ACK, DEAD, QUEUED, RETRY, RETRYING, WAITING, error_info
from .retry import next_delay
from .testdaemon import Supervisor, write_config  # noqa: F401 - the fixtures' real daemon, documented here


class Clock:
    """The broker's clock during ``run_jobs``: real time plus what ``advance`` added."""

    def __init__(self):
        self.offset = 0.0

    def now(self):
        return time.time() + self.offset

    def advance(self, seconds):
        self.offset += max(0.0, seconds)


clock = Clock()  # shared by every run_jobs call of the process, so a retry's due time stays consistent


@dataclasses.dataclass
class Ran:
    """One attempt ``run_jobs`` made: ``outcome`` is "done", "retry" or "dead"."""

    job_id: str
    type: str
    attempt: int
    outcome: str
    reason: str | None = None  # why it failed (retry, dead): "exception", "timeout", "bad_payload"...
    result: object = None
    error: str = ""  # "ValueError: boom"
    delay: float | None = None  # retry: the backoff the verdict chose (the clock skipped it)


_OUTCOMES = {ACK: "done", RETRY: "retry", DEAD: "dead"}
MAX_RUNS = 10_000  # a handler that always asks to be retried later must not loop forever


def run_jobs(client=None, until="idle", *, handlers=None, queues=None, max_runs=MAX_RUNS):
    """Run queued jobs in-process, in claim order; return a list of ``Ran``, one per attempt.

    ``until="idle"``: until no job is due and none it retried is waiting; an int: at most that
    many attempts. ``queues``: a name or a list (default: the client's). ``handlers``: a folder,
    a handler or module, or a list of them (default: the client's config's handlers folder).
    ``client``: default ``supervisor.configure``'s; with no default set, it is the default while
    the jobs run (a handler's follow-up ``.enqueue()``). Called from a coroutine (an async
    test), the jobs run on a thread of their own.
    """
    client = client or default_client()  # this thread's (a default made from a URL is one per thread)
    if _in_event_loop():
        # An async handler runs on a loop of its own, as in a daemon's child, and a thread that
        # runs a loop already cannot run another: each such job failed "Cannot run the event
        # loop while another loop is running". (No soft timeout off the main thread.)
        return _on_a_thread(run_jobs, client, until, handlers=handlers, queues=queues, max_runs=max_runs)
    cfg = client.config or config_module.from_dict({})
    handlers = _handlers(handlers, cfg)
    limit = max_runs if until == "idle" else int(until)
    broker = _own_broker(client.url)
    on_test_clock(client)
    toolkit.configure(cfg.toolkit)
    queues = queue_list(queues) or list(client.queues)
    ran = []
    # As a daemon's child does (``configure_unless_set``): with no default client chosen, a
    # handler's follow-up ``.enqueue()`` goes to the broker its job came from, here ``client``.
    lent = jobref.save() is None and jobref._from_environment() is None
    if lent:
        jobref.configure(client=client)
    limits = registry.type_limits(cfg, handlers) or None
    waited_for_token = False
    try:
        while len(ran) < limit:
            jobs = broker.claim(queues, 1, cfg.broker.lease_seconds, "run_jobs", limits)
            if not jobs:
                due = _next_retry(broker, queues)
                if due is None and not waited_for_token:
                    # Due jobs a rate_limit holds back: the daemon runs them as tokens come back.
                    due, waited_for_token = _next_token(broker, queues, limits), True
                if due is None:
                    break
                clock.advance(due - clock.now())  # the backoff (or the wait for a token) passes at once
                continue
            waited_for_token = False
            job = jobs[0]
            outcome, reply = _attempt(job, cfg, handlers)
            write = Write(job, outcome.op, info={"host": socket.gethostname(), "runner": "run_jobs"})
            if outcome.op == ACK:
                write.result = outcome.result
            elif outcome.failed:
                write.error = error_info(outcome.reason, outcome.error_class, outcome.message, outcome.traceback)
                write.reason, write.delay = outcome.reason, outcome.delay or 0.0
            write.apply(broker)
            ran.append(Ran(job.id, job.type, job.attempt, _OUTCOMES.get(outcome.op, outcome.op),
                           outcome.reason, outcome.result,
                           f"{outcome.error_class}: {outcome.message}" if outcome.failed else "",
                           outcome.delay if outcome.op == RETRY else None))
    finally:
        if lent:
            jobref.restore(None)
        broker.close()
    return ran


def _in_event_loop():
    if "asyncio" not in sys.modules:  # nothing imported it: no loop runs
        return False
    import asyncio

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _on_a_thread(fn, *args, **kwargs):
    """``fn(...)`` on a new thread, in a copy of this context; its result, or its exception raised here."""
    import contextvars

    context, out = contextvars.copy_context(), {}

    def target():
        try:
            out["value"] = context.run(fn, *args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - raised again in the caller's thread
            out["error"] = exc

    thread = threading.Thread(target=target, name="run_jobs")
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def _next_retry(broker, queues):
    """When the earliest job waiting out a retry backoff is due, or None."""
    db = sqlite3.connect(f"file:{broker.path}?mode=ro", uri=True)
    try:
        marks = ",".join("?" * len(queues))
        (due,) = db.execute(f"SELECT min(run_at) FROM jobs WHERE state = 'retrying' AND queue IN ({marks})",
                            queues).fetchone()
    finally:
        db.close()
    return due


def _next_token(broker, queues, limits):
    """When a due job that only its type's rate_limit holds back gets a token, or None."""
    rates = {t: lim.rate for t, lim in (limits or {}).items() if lim.rate is not None}
    if not rates:
        return None
    db = sqlite3.connect(f"file:{broker.path}?mode=ro", uri=True)
    try:
        marks, types = ",".join("?" * len(queues)), sorted(rates)
        held = [row[0] for row in db.execute(
            f"SELECT DISTINCT type FROM jobs WHERE state = 'queued' AND run_at <= ? AND queue IN ({marks})"
            f" AND queue NOT IN (SELECT queue FROM paused_queues) AND type IN ({','.join('?' * len(types))})",
            [clock.now(), *queues, *types])]
    finally:
        db.close()
    if not held:
        return None
    return clock.now() + min(rates[t][1] / rates[t][0] for t in held)  # a bucket refills a token in per / count


def _attempt(job, cfg, handlers):
    """(verdict, reply) of one attempt, as the master would judge the child's reply."""
    settings = registry.job_settings(cfg, handlers, job)
    backoff = lambda failures: next_delay(failures, cfg.jobs.backoff_base, cfg.jobs.backoff_cap,  # noqa: E731
                                          cfg.jobs.jitter)
    if job.type not in handlers:
        return verdict.failure(job.attempt, settings.max_attempts, protocol.UNKNOWN_TYPE, "UnknownType",
                               f"no handler for job type {job.type!r}", backoff), None
    message = protocol.run_message(job, settings.max_attempts, settings.soft_timeout)
    message = json.loads(protocol.encode(message)[4:])  # what crosses the pipe is JSON
    with _soft_timeouts() as guard:
        reply = tracing.run_span(message["job"], lambda: child.run_job(message["job"], handlers,
                                                                       settings.soft_timeout if guard.usable else None))
    if guard.interrupted:
        # Ctrl-C: the handler saw a KeyboardInterrupt, the test is what was interrupted (it failed the
        # attempt, the job ran again and pytest went on with the next test).
        raise KeyboardInterrupt
    toolkit.end_job()  # as a child does after each job: a transaction it left open is rolled back
    reply = json.loads(child.reply_frame(reply)[4:])  # over the size limit: result_too_large, as in a child
    return verdict.judge(job.attempt, settings.max_attempts, verdict.Ending(reply=reply), backoff), reply


class _soft_timeouts:
    """The child's SIGALRM handler for the soft timeout, while one attempt runs (main thread only);
    ``interrupted``: a SIGINT (Ctrl-C) came meanwhile."""

    def __enter__(self):
        self.usable = threading.current_thread() is threading.main_thread()
        self.interrupted = False
        if self.usable:
            from .child.timeouts import _on_alarm

            # The process has one such timer, and a test may be using it (pytest-timeout's signal
            # method): the job's replaced it and then cleared it, and a hung test was never stopped.
            self.timer, self.started = signal.getitimer(signal.ITIMER_REAL), time.monotonic()
            self.previous = signal.signal(signal.SIGALRM, _on_alarm)
            self.previous_int = signal.getsignal(signal.SIGINT)
            if self.previous_int is signal.default_int_handler:  # not a test's own, nor ignored (in the background)
                signal.signal(signal.SIGINT, self._on_interrupt)
        return self

    def _on_interrupt(self, signum, frame):
        self.interrupted = True
        signal.default_int_handler(signum, frame)  # KeyboardInterrupt in the handler: it ends the attempt

    def __exit__(self, *exc):
        if self.usable:
            signal.signal(signal.SIGALRM, self.previous)
            if self.previous_int is signal.default_int_handler:
                signal.signal(signal.SIGINT, self.previous_int)
            left, interval = self.timer
            if left > 0:  # due meanwhile: at once, to the test's own handler
                signal.setitimer(signal.ITIMER_REAL, max(left - (time.monotonic() - self.started), 0.001), interval)


def _own_broker(url):
    from .backends.base import open_broker

    broker = open_broker(url)
    if not hasattr(broker, "path"):
        broker.close()
        raise ValueError("run_jobs needs a SQLite broker (the tangguh_broker fixture gives one)")
    broker.now = clock.now  # claims, leases and retry due times all read the test's clock
    return broker


def on_test_clock(client):
    """Put ``client``'s broker on ``clock``: the times it stamps (a ``delay``'s run time, an
    ``expires_in``'s deadline) then count from the clock ``run_jobs`` claims by."""
    if hasattr(client.broker, "path"):  # SQLite: run_jobs refuses any other broker
        client.broker.now = clock.now


def _handlers(given, cfg):
    """``{type: HandlerSpec}`` from a folder, handler functions or modules (default: the config's folder).

    A handler file the test imported itself is run as that module, not a fresh copy of it: what
    the test patched there (``monkeypatch.setattr(billing, "charge_card", fake)``) is what runs.
    """
    if given is None or isinstance(given, (str, os.PathLike)):
        folder = cfg.supervisor.handlers if given is None else os.fspath(given)
        return registry.load_handlers(folder, importer=_imported_or_fresh)
    if isinstance(given, dict):
        return given
    if callable(given) or isinstance(given, type(sys)):
        given = [given]  # one handler, or one module
    specs = {}
    for item in given:
        is_module = isinstance(item, type(sys))
        if not is_module and getattr(item, registry._MARK, None) is None:
            # Dropped, its jobs would end unknown_type: a test of a handler that never ran.
            raise ValueError(f"run_jobs(handlers=...): {item!r} is not a handler made by @supervisor.job")
        for value in vars(item).values() if is_module else [item]:
            meta = getattr(value, registry._MARK, None)
            if meta is not None:
                fn = registry.handler_function(value)
                specs[meta["type"]] = registry.HandlerSpec(fn=fn, is_async=_is_async(fn), **meta)
    return specs


def _imported_or_fresh(path, module_name):
    real, base = os.path.realpath(path), os.path.basename(path)
    for module in list(sys.modules.values()):
        name, file = getattr(module, "__name__", ""), getattr(module, "__file__", None)
        # tangguh_handlers.* are earlier loads of this folder, never the module the test holds.
        if (isinstance(file, str) and os.path.basename(file) == base and not name.startswith("tangguh_handlers.")
                and os.path.realpath(file) == real):
            return module
    return registry._import_path(path, module_name)


def _is_async(fn):
    import inspect

    return inspect.iscoroutinefunction(fn)


# -- assertions ------------------------------------------------------------------------------------
def jobs_in_state(state=None, type=None, client=None):
    """The stored jobs (``model.Job``) in ``state`` ("queued", "retrying", "done", "dead"..., or a tuple of
    states), of ``type`` (a name, a handler or ``JobRef``, or a tuple of them), oldest first. Reads the
    SQLite broker's file."""
    client = client or default_client()
    type = _type_names(type)
    from .backends.base import open_broker

    with open_broker(client.url) as broker:
        if not hasattr(broker, "path"):
            raise ValueError("jobs_in_state reads a SQLite broker (the tangguh_broker fixture gives one)")
        db = sqlite3.connect(f"file:{broker.path}?mode=ro", uri=True)
        try:
            sql, args = "SELECT id FROM jobs WHERE 1=1", []
            for column, value in (("state", state), ("type", type)):
                values = [value] if isinstance(value, str) else list(value or ())
                if values:
                    sql += f" AND {column} IN ({','.join('?' * len(values))})"
                    args += values
            # Oldest first: ids made in one millisecond need not sort so; the table's rows do.
            ids = [row[0] for row in db.execute(sql + " ORDER BY queued_at, rowid", args)]
        finally:
            db.close()
        return [broker.get(job_id) for job_id in ids]


# Stored and still to run: waiting on parents, queued (a delayed job too), or waiting out a retry backoff.
ENQUEUED = (WAITING, QUEUED, RETRYING)


def _type_names(types):
    """Job type names: a handler or ``JobRef`` is its type (``assert_enqueued(send_receipt)``)."""
    if isinstance(types, jobref.JobRef):
        return types.type
    if types is None or isinstance(types, str):
        return types
    return [t.type if isinstance(t, jobref.JobRef) else t for t in types]


def _matching(type, where, client, state=ENQUEUED):
    where = where or {}
    return [job for job in jobs_in_state(state, type, client)
            if all(job.payload.get(k) == v if k not in _JOB_KEYS else getattr(job, k) == v
                   for k, v in where.items())]


# ``where`` keys that are the job's own fields; any other key is a payload field.
_JOB_KEYS = ("queue", "resource_id", "idempotency_key", "priority", "max_attempts")


def assert_enqueued(type, where=None, count=1, client=None):
    """Exactly ``count`` enqueued jobs of ``type`` whose payload (or queue, resource_id...) matches ``where``.

    Enqueued: stored and still to run (``ENQUEUED``: waiting on its parents, queued, or retrying).
    """
    type = _type_names(type)  # the handler's name in the message, not its repr
    found = _matching(type, where, client)
    if len(found) != count:
        stored = [(j.state, j.payload) for j in jobs_in_state(ENQUEUED, type, client)]
        raise AssertionError(f"expected {count} enqueued {type!r} job(s) matching {where or {}}, found {len(found)}"
                             f" (waiting, queued or retrying): {stored}")
    return found


def assert_not_enqueued(type, where=None, client=None):
    """No enqueued job (waiting, queued or retrying) of ``type`` matches ``where``."""
    assert_enqueued(type, where, 0, client)


# -- a real supervisor -----------------------------------------------------------------------------
