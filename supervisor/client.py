"""The producer API: put jobs on a broker from application code.

    from supervisor.client import Client

    with Client.from_config() as client:          # ./tangguh.toml, /etc/tangguh/config.toml
        job_id = client.enqueue("send_email", {"to": "a@example.com"},
                                idempotency_key="welcome:42", resource_id="user:42")

Everything a caller passes is checked before the broker is touched, so a bad
payload, an unknown queue or a negative delay raises ``BadInput`` and stores
nothing. The broker connection is opened on first use, not at construction:
creating a client at import time costs nothing and cannot fail on the network.

Defaults come from the config when the client was made from one: the queue
from ``[jobs.types.<type>].queue`` (else ``default`` when it is a configured
queue, else the first of ``broker.queues``), ``max_attempts`` from
``[jobs.types.<type>]`` then ``[jobs]``, ``timeout`` from
``[jobs.types.<type>]`` only (left unset otherwise, so the supervisor applies
the handler decorator's timeout, then ``[jobs].timeout``).

A client may be shared by threads (a module-level client in a threaded web
app, or the default client ``supervisor.configure(client=...)`` hands to every
thread): its calls take turns on its one broker connection, each holding the
client's lock for its whole broker call, so a workflow's transaction is never
joined by another thread's statements. ``wait`` blocks, so it runs on a broker
of its own and holds no lock; the client keeps up to four of those open
between waits (``waitbrokers.py``) (a web app waiting in every request must not open
connections per request). ``client.broker``, the raw broker, is not
guarded: use it from one thread at a time. After a fork the PostgreSQL and
Redis brokers open connections of their own in the child.
"""
import contextlib
import inspect
import logging
import os
import threading
import weakref

from . import config as config_module
from . import tracing
from .backends.base import open_broker, scheme_of
from .backends.control import check_ids, check_timeout, listed
from .errors import BadInput, BrokerError, ConfigError
from .jobfilter import JobFilter, check_page, decode_cursor
from .jobref import job_args, type_name
from .logs import job_fields
from .model import FINISHED, NewJob, trace_made
from .waitbrokers import WaitBrokers

# One DEBUG record per stored job, with its ids: the first line of a job's
# trail, which the supervisor's claim/start/done/acked records continue.
log = logging.getLogger("tangguh.client")

DEFAULT_QUEUE = "default"

# Keyword arguments of ``Client.enqueue`` that describe the job (the rest go to the broker).
JOB_OPTIONS = ("queue", "resource_id", "idempotency_key", "delay", "max_attempts", "timeout", "trace_id", "priority",
               "expires_in", "depends_on")


# Every client of this process, so that a fork can give each a fresh lock.
_clients = weakref.WeakSet()


class Client:
    """Enqueue jobs and read their state. Thread-safe: calls from several threads take turns."""

    def __init__(self, url, *, queues=None, config=None):
        if scheme_of(url) == "sqlite":  # fail now on a URL no broker can open (BrokerError)
            url = _absolute_sqlite(url)
        self.url = url
        self.config = config
        self.queues = queue_list(queues) or list(config.broker.queues if config else [DEFAULT_QUEUE])
        # Only a client made from a config knows the set of queues the supervisors serve.
        self.strict_queues = config is not None or queues is not None
        self._broker = None
        self._waits = WaitBrokers(url)
        # Re-entrant, with _busy: a signal handler that calls the client while its own thread is in
        # a call is refused at once (a call inside a call would share a transaction or a reply).
        self._lock = threading.RLock()
        self._busy = False
        _clients.add(self)

    @classmethod
    def from_url(cls, url, queues=None):
        """A client for the broker at ``url`` (``sqlite:///path``, ``redis://``, ``postgresql://``)."""
        return cls(url, queues=queues)

    @classmethod
    def from_config(cls, path=None):
        """A client for the broker a config file names (default: the usual config locations).

        ``path`` may also be an already loaded ``config.Config``. Raises ``ConfigError``, also for no
        config file at all (the defaults would enqueue into a new ./tangguh.db no supervisor reads)."""
        if not isinstance(path, config_module.Config) and config_module.find_config(path) is None:
            raise ConfigError(f"no config file: neither {' nor '.join(config_module.DEFAULT_PATHS)} exists"
                              f" (here: {os.getcwd()}); pass the config's path, or use Client.from_url(url)")
        cfg = path if isinstance(path, config_module.Config) else config_module.load(path)
        return cls(cfg.broker.url, config=cfg)

    # -- the broker ---------------------------------------------------------
    @property
    def broker(self):
        if self._broker is None:
            with self._lock:  # two threads' first calls must not open two brokers
                if self._broker is None:
                    self._broker = open_broker(self.url)
        return self._broker

    def close(self):
        with self._lock:  # not under another thread's call
            if self._broker is not None:
                broker, self._broker = self._broker, None
                broker.close()
        self._waits.close()

    @contextlib.contextmanager
    def _guard(self):
        """The broker, for one call: threads take turns."""
        with self._lock:
            if self._busy:
                raise RuntimeError("this Client is in a call on this same thread already (a signal handler"
                                   " interrupted it?): use another Client there")
            self._busy = True
            try:
                yield self.broker
            finally:
                self._busy = False

    def _run(self, method_name, *args, **kwargs):
        with self._guard() as broker:
            return getattr(broker, method_name)(*args, **kwargs)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- producing ----------------------------------------------------------
    def new_job(self, type, payload, *, queue=None, resource_id=None, idempotency_key=None, delay=0,
                max_attempts=None, timeout=None, trace_id=None, priority=0, expires_in=None,
                depends_on=()):
        """The validated ``NewJob`` that ``enqueue`` would store (raises ``BadInput``)."""
        type, payload, queue = job_args(self, type, payload, queue)  # a handler: as its .enqueue (jobref)
        overrides = self.config.job_type(type) if self.config is not None and isinstance(type, str) else None
        if queue is None:
            queue = (overrides and overrides.queue) or self.default_queue()
        if self.strict_queues and queue not in self.queues:
            raise BadInput(f"queue {queue!r} is not one of the configured broker.queues ({', '.join(self.queues)})")
        if max_attempts is None:
            max_attempts = (overrides and overrides.max_attempts) or (
                self.config.jobs.max_attempts if self.config is not None else NewJob.max_attempts)
        if timeout is None and overrides is not None:
            timeout = overrides.timeout
        job = NewJob(type, payload, queue=queue, resource_id=resource_id, idempotency_key=idempotency_key,
                     delay=delay, max_attempts=max_attempts, timeout=timeout, trace_id=trace_id, priority=priority,
                     expires_in=expires_in, depends_on=depends_on)
        return job.validate()

    def default_queue(self):
        return DEFAULT_QUEUE if DEFAULT_QUEUE in self.queues or not self.queues else self.queues[0]

    def enqueue(self, type, payload, *, queue=None, resource_id=None, idempotency_key=None, delay=0,
                max_attempts=None, timeout=None, trace_id=None, priority=0, expires_in=None, depends_on=(),
                **broker_kwargs):
        """Store one job; return its id (the existing job's id when ``idempotency_key`` matches
        an unfinished job). ``expires_in``: seconds after which the job, if not started, ends
        ``expired`` instead of running. ``depends_on``: job ids (or ``(id, on)``) it waits for
        (``supervisor.workflows``). ``broker_kwargs`` go to the broker, e.g. ``conn=`` for
        PostgreSQL's transactional enqueue."""
        with tracing.enqueue_span([type_name(type)], queue) as span:  # OpenTelemetry, when installed
            job = self.new_job(type, payload, queue=queue, resource_id=resource_id, idempotency_key=idempotency_key,
                               delay=delay, max_attempts=max_attempts, timeout=timeout,
                               trace_id=trace_id or span.traceparent, priority=priority, expires_in=expires_in,
                               depends_on=depends_on)
            job_id = self._call("enqueue", job, broker_kwargs)
            span.stored([job_id])
            _log_enqueued(job, job_id)
        return job_id

    def enqueue_many(self, jobs, **broker_kwargs):
        """Store several jobs in one round trip; return their ids in order.

        Each item is a dict of ``enqueue``'s arguments (``{"type": ..., "payload": ..., "queue": ...}``)
        or a tuple ``(type, payload)`` / ``(type, payload, {options})``. All are checked before
        any is stored.
        """
        items = []
        for i, item in enumerate(jobs):
            try:
                items.append(_job_args(item))
            except BadInput as exc:
                raise BadInput(f"job {i}: {exc}") from None
        if not items:
            return []
        with tracing.enqueue_span([type_name(args[0]) for args, _ in items]) as span:  # OpenTelemetry, when installed
            new_jobs = []
            traceparent = span.traceparent
            for i, (args, options) in enumerate(items):
                if traceparent is not None and not options.get("trace_id"):
                    options = dict(options, trace_id=traceparent)
                try:
                    new_jobs.append(self.new_job(*args, **options))
                except BadInput as exc:
                    raise BadInput(f"job {i}: {exc}") from None
            ids = self._call("enqueue_many", new_jobs, broker_kwargs)
            span.stored(ids)
            for job, job_id in zip(new_jobs, ids):
                _log_enqueued(job, job_id)
        return ids

    # -- workflows (supervisor.workflows) -------------------------------------
    def chain(self, steps, on="success"):
        """Enqueue steps that each wait for the previous one; returns their ids."""
        from . import workflows

        return workflows.chain(self, steps, on)

    def group(self, members, then=None, on="success"):
        """Enqueue members and an optional ``then`` callback waiting on all of them; returns a ``Flow``."""
        from . import workflows

        return workflows.group(self, members, then, on)

    def batch(self, members, on_success=None, on_complete=None):
        """A group with ``on_success``/``on_complete`` callbacks and a record; returns a ``Batch``."""
        from . import workflows

        return workflows.batch(self, members, on_success, on_complete)

    def store(self, jobs, **broker_kwargs):
        """Store validated ``NewJob``s in one atomic write (a workflow); returns their ids."""
        with tracing.enqueue_span([job.type for job in jobs]) as span:
            # The steps were validated before this span existed, so each has a trace id
            # already: a made-up one gives way to the producer's trace, a caller's stays.
            for job in jobs:
                if span.traceparent is not None and (not job.trace_id or trace_made(job)):
                    job.trace_id = span.traceparent
            ids = self._call("enqueue_many", jobs, broker_kwargs)
            span.stored(ids)
            for job, job_id in zip(jobs, ids):
                _log_enqueued(job, job_id)
        return ids

    def _call(self, method_name, arg, broker_kwargs):
        with self._guard() as broker:
            method = getattr(broker, method_name)
            if broker_kwargs:
                try:
                    inspect.signature(method).bind(arg, **broker_kwargs)
                except TypeError:
                    raise BadInput(f"the {type(broker).__name__} does not accept "
                                   f"{', '.join(sorted(broker_kwargs))}= in {method_name}") from None
            return method(arg, **broker_kwargs)

    # -- reading ------------------------------------------------------------
    def get(self, job_id):
        """The ``Job`` with that id, or None. BadInput for an id no job can have."""
        return self._run("get", _one_id(job_id))

    def stats(self, queues=None):
        """``{queue: QueueStats}`` for ``queues``, a name or a list (default: the client's queues)."""
        return self._run("stats", queue_list(queues) or list(self.queues))

    def wait(self, job_id, timeout):
        """The job once it is finished (done, dead, cancelled or expired), or None after ``timeout`` seconds.

        Woken by the broker's own notification, not a poll. BadInput for an unknown id."""
        job_id, timeout = _one_id(job_id), check_timeout(timeout)  # a finished job's answer too
        if self._lock.acquire(blocking=False):  # never queued behind another thread's call
            try:
                job = None if self._busy else self.broker.get(job_id)
            finally:
                self._lock.release()
            if job is not None and job.state in FINISHED:
                return job  # finished already: no broker of its own to open
        # On a broker of its own: holding the lock for up to ``timeout`` would stall every other thread.
        return self._waits.wait(job_id, timeout)

    # -- control ------------------------------------------------------------
    def cancel(self, job_ids, by=None, reason=None):
        """Cancel jobs: ``{job_id: "cancelled" | "requested" | "already_<state>" | "unknown"}``.

        A waiting job ends ``cancelled`` now; a running one is asked to stop (its
        supervisor learns of it at its next heartbeat)."""
        return self._run("cancel", listed(job_ids, "job ids"), by, reason)

    def pause(self, queue, by=None):
        """Stop every supervisor sharing the broker from claiming from ``queue`` (running jobs finish)."""
        self._run("pause", queue, by)

    def resume(self, queue):
        self._run("resume", queue)

    def paused(self):
        """``{queue: {"by", "at"}}`` for every paused queue."""
        return self._run("paused")

    # -- job control --------------------------------------------------------
    def search(self, filter=None, *, cursor=None, limit=50, order="newest", **fields):
        """A ``jobfilter.Page`` of the jobs a filter selects, newest first (``order="oldest"``: oldest).

        The filter is a ``JobFilter``, a dict, or keyword arguments:
        ``client.search(state="dead", type="email", payload={"customer.id": 7})``.
        Pass the page's ``next_cursor`` as ``cursor`` for the next page.
        """
        f = _filter(filter, fields)
        check_page(limit, order)
        if cursor is not None:
            decode_cursor(cursor, order)
        return self._run("search", f, cursor=cursor, limit=limit, order=order)

    def count(self, filter=None, *, exact_up_to=10_000, **fields):
        """A ``jobfilter.Count``: exact up to ``exact_up_to``, an estimate (``exact=False``) past it."""
        return self._run("count", _filter(filter, fields), exact_up_to=exact_up_to)

    def requeue(self, job_ids):
        """Put dead, cancelled or expired jobs back on their queue; ``{id: outcome}``."""
        return self._run("requeue", _ids(job_ids))

    def discard(self, job_ids):
        """Delete jobs that are not running; ``{id: outcome}``."""
        return self._run("discard", _ids(job_ids))


def queue_list(queues):
    """Queues given to a call: one name is that queue (not its letters); ``queues=5`` BadInput."""
    return [] if queues is None else listed(queues, "queues")


def _one_id(job_id):
    """The id, or BadInput naming it: one line on every broker (PostgreSQL answered an int with
    a schema error, a lone surrogate was an encoding error)."""
    return check_ids([job_id])[0]


def _absolute_sqlite(url):
    """A relative ``sqlite:///jobs.db`` made absolute once, against today's working directory: the
    client's later brokers (wait's own, one reopened after ``close``, a forked child's) open the
    file its enqueues went to, wherever the process has moved since."""
    try:
        return config_module.resolve_broker_url(url, os.getcwd())
    except config_module.ConfigError:
        return url  # opening it names what is wrong, as a BrokerError


def _after_fork_in_child():
    # A lock another thread held at the fork stays held in the child, where that thread is gone.
    for client in list(_clients):
        client._lock, client._busy = threading.RLock(), False
        client._waits.after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _filter(filter, fields):
    if filter is not None and fields:
        raise BadInput("give a filter or filter keywords, not both")
    if isinstance(filter, JobFilter):
        return filter
    return JobFilter.from_dict(fields if filter is None else filter)


def _ids(job_ids):
    job_ids = listed(job_ids, "job ids")
    if not all(isinstance(i, str) and i for i in job_ids):
        raise BadInput("job ids must be non-empty strings")
    return job_ids


def _job_args(item):
    """(positional, keyword) arguments of ``Client.new_job`` for one ``enqueue_many`` item."""
    if isinstance(item, dict):
        item = dict(item)
        try:
            args = (item.pop("type"), item.pop("payload"))
        except KeyError as exc:
            raise BadInput(f"missing {exc.args[0]!r}") from None
    elif isinstance(item, (tuple, list)) and len(item) in (2, 3):
        if len(item) == 3 and not isinstance(item[2], dict):  # dict(5): a raw TypeError, not BadInput
            raise BadInput(f"options must be a dict, got {type(item[2]).__name__}")
        args, item = tuple(item[:2]), dict(item[2]) if len(item) == 3 else {}
    else:
        raise BadInput("expected a dict or a (type, payload[, options]) tuple")
    unknown = set(item) - set(JOB_OPTIONS)
    if unknown:
        raise BadInput(f"unknown option(s) {', '.join(sorted(unknown))}")
    return args, item


__all__ = ["Client", "BadInput", "BrokerError"]


def _log_enqueued(job, job_id):
    if log.isEnabledFor(logging.DEBUG):
        deduped = job_id != job.id  # an unfinished job with the same idempotency key already existed
        log.debug("job enqueued" + (" (deduplicated)" if deduped else ""),
                  extra=job_fields(job, job_id=job_id, event="enqueue"))
