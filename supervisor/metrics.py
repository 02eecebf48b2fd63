"""Prometheus metrics, owned by the master and rendered with ``prometheus_client``.

One ``CollectorRegistry`` lives in the master; nothing is shared with the
children (no multiprocess mode). Children report what their toolkit helpers
counted as a ``"metrics"`` dict in each result message; the master adds it up
here (``child_deltas``). Queue gauges are sampled from the broker on a timer
by the main loop (``sample_queues``), never per scrape, so a scraper hammering
``/metrics`` costs the broker nothing. Gauges about the master itself
(workers, heartbeat) are read at scrape time from the live objects.

``HttpExporter`` serves ``GET /metrics`` from the main loop's selector: a
non-blocking listener, a bounded request, a client deadline, HTTP/1.0 and
``Connection: close``. No thread (docs/design.md, process-model rules).
"""
import bisect
import socket
import time

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector,
                               disable_created_metrics, generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from .oneshot import OneShotServer
from .protocol import finite

SAMPLE_SECONDS = 5.0  # how often queue gauges are refreshed from the broker

# What a child may report per job (``ctx.metrics``), and the counter each key feeds.
CHILD_KEYS = ("duplicates_suppressed", "lock_acquired", "lock_failed", "lock_wait_seconds", "cache_hit",
              "cache_miss", "cache_rebuild", "cache_stale_served")

DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
COMPLETE_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 900, 1800, 3600, 4 * 3600, 86400)
# What generate_latest writes: the classic text format every Prometheus version reads.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
CANCEL_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 15, 30, 60, 120)
BROKER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)

JOB = ("queue", "type")
UNKNOWN_TYPE = "unknown"  # the type label of every job type no handler serves


class Metrics:
    """Every metric the daemon exports; ``render()`` gives the text exposition."""

    def __init__(self, arbiter=None):
        # No *_created series: they double the series count and say only when the master started.
        disable_created_metrics()
        self.arbiter = arbiter
        self.before_render = []  # callables run before each render: counts held back until then (Status.flush)
        self.registry = r = CollectorRegistry(auto_describe=True)
        c = lambda name, doc, labels=(): Counter(name, doc, labels, registry=r)  # noqa: E731
        g = lambda name, doc, labels=(): Gauge(name, doc, labels, registry=r)  # noqa: E731

        # queue state, sampled from the broker
        self.queue_ready = g("tangguh_queue_ready_jobs", "Jobs due now, waiting for a worker", ("queue",))
        self.queue_scheduled = g("tangguh_queue_scheduled_jobs", "Jobs delayed or waiting for a retry backoff",
                                 ("queue",))
        self.queue_in_flight = g("tangguh_queue_in_flight_jobs", "Jobs leased by any supervisor", ("queue",))
        self.queue_waiting = g("tangguh_queue_waiting_jobs", "Workflow jobs waiting on their parents", ("queue",))
        self.queue_dead = g("tangguh_queue_dead_jobs", "Jobs in the dead-letter queue", ("queue",))
        self.queue_oldest = g("tangguh_queue_oldest_ready_age_seconds",
                              "Seconds the oldest due job has waited (0 when none is due)", ("queue",))
        self.queue_paused = g("tangguh_queue_paused", "1 while the queue is paused (no supervisor claims from it)",
                              ("queue",))
        self.queue_sampled = g("tangguh_queue_sample_timestamp_seconds",
                               "Unix time of the last successful queue sample")
        self.sampled_queues = set()

        # outcomes
        self.claimed = c("tangguh_jobs_claimed_total", "Attempts started (jobs claimed)", JOB)
        self.succeeded = c("tangguh_jobs_succeeded_total", "Jobs that ended ok", JOB)
        self.failed = c("tangguh_jobs_failed_total", "Failed attempts, by reason", JOB + ("reason",))
        self.retried = c("tangguh_jobs_retried_total", "Failed attempts scheduled for a retry", JOB + ("reason",))
        self.dead = c("tangguh_jobs_dead_lettered_total", "Jobs moved to the dead-letter queue", JOB + ("reason",))
        self.cancelled = c("tangguh_jobs_cancelled_total", "Jobs ended cancelled by this supervisor (running"
                           " or claimed when their cancel came)", ("type",))
        self.expired = c("tangguh_jobs_expired_total", "Jobs this supervisor's claims ended expired (not started"
                         " in time)", ("type",))
        self.cancel_latency = Histogram("tangguh_cancel_latency_seconds", "From a running job's cancel request"
                                        " to its handler stopped", buckets=CANCEL_BUCKETS, registry=r)
        self.duration = JobHistogram("tangguh_job_duration_seconds", "Handler run time of one attempt",
                                     DURATION_BUCKETS, r)
        self.complete = JobHistogram("tangguh_job_time_to_complete_seconds",
                                     "From enqueue to the ack of the successful attempt", COMPLETE_BUCKETS, r)

        # toolkit, as reported by the children
        self.duplicates = c("tangguh_duplicates_suppressed_total",
                            "Effects skipped because the idempotency key was already done", JOB)
        self.lock_acquired = c("tangguh_lock_acquired_total", "Resource locks acquired", JOB)
        self.lock_failed = c("tangguh_lock_failed_total", "Resource lock acquisitions that failed (contention)",
                             JOB)
        self.lock_wait = c("tangguh_lock_wait_seconds_total", "Seconds spent waiting for resource locks", JOB)
        self.cache_hit = c("tangguh_cache_hits_total", "Cache reads served fresh", JOB)
        self.cache_miss = c("tangguh_cache_misses_total", "Cache reads that found nothing", JOB)
        self.cache_rebuild = c("tangguh_cache_rebuilds_total", "Cache entries recomputed", JOB)
        self.cache_stale = c("tangguh_cache_stale_served_total", "Stale cache entries served while rebuilding",
                             JOB)

        # leases, timeouts, children
        self.leases_lost = c("tangguh_leases_lost_total",
                             "Leases found taken over (renewal or outcome refused); the result is dropped")
        self.lease_expiries = c("tangguh_lease_expiries_total",
                                "Jobs claimed again after an earlier lease ran out (visibility timeout)", JOB)
        self.orphans_released = c("tangguh_orphans_released_total", "Jobs a claim given up on had leased to this"
                                  " supervisor, found and released (never run here, no attempt spent)", JOB)
        self.timeouts = c("tangguh_timeouts_total", "Attempts over their timeout: soft (JobTimeout raised) or"
                          " hard (child killed)", JOB + ("kind",))
        self.crashed = c("tangguh_children_crashed_total",
                         "Children that died unasked: mid_job, idle, or at boot", ("when",))
        self.restarted = c("tangguh_children_restarted_total", "Children replaced after an unplanned exit")
        self.recycled = c("tangguh_children_recycled_total", "Children retired on max_jobs_per_child or RSS",
                          ("reason",))
        self.spawned = c("tangguh_children_spawned_total", "Children forked")
        self.spawn_failures = c("tangguh_spawn_failures_total", "Forks refused by the system (descriptors, processes)")
        self.reloads = c("tangguh_reloads_total", "SIGHUP reloads", ("result",))

        # the supervisor's own health
        self.broker_rtt = Histogram("tangguh_broker_round_trip_seconds", "Broker calls from the main loop",
                                    ("op",), buckets=BROKER_BUCKETS, registry=r)
        self.broker_errors = c("tangguh_broker_errors_total", "Failed broker calls", ("source",))

        for reason in ("mid_job", "idle", "boot"):
            self.crashed.labels(reason)
        for result in ("ok", "failed"):
            self.reloads.labels(result)
        self.broker_errors.labels("main")
        if arbiter is not None:
            r.register(_Live(arbiter))
        ProcessCollector(registry=r)

    # -- recording --------------------------------------------------------------------
    def job_labels(self, job):
        """(queue, type) labels of ``job``; producers choose types, so only served types become labels.

        The queue needs no such care: the master claims only its configured queues.
        """
        if self.arbiter is not None and job.type not in self.arbiter.handlers:
            return job.queue, UNKNOWN_TYPE
        return job.queue, job.type

    def type_label(self, job_type):
        """A job type as a label: served types only (producers choose types; labels must not grow)."""
        return job_type if self.arbiter is None or job_type in self.arbiter.handlers else UNKNOWN_TYPE

    def child_deltas(self, job, deltas):
        """Add a child's ``{"metrics": {...}}`` for ``job``; unknown keys and bad values are ignored."""
        if not isinstance(deltas, dict) or not deltas:
            return  # most jobs use no lock and no cache: nothing to add
        labels = self.job_labels(job)
        targets = {"duplicates_suppressed": self.duplicates, "lock_acquired": self.lock_acquired,
                   "lock_failed": self.lock_failed, "lock_wait_seconds": self.lock_wait,
                   "cache_hit": self.cache_hit, "cache_miss": self.cache_miss, "cache_rebuild": self.cache_rebuild,
                   "cache_stale_served": self.cache_stale}
        for key, counter in targets.items():
            if any(k.startswith(key.split("_")[0] + "_") for k in deltas):
                # A lock or cache user gets all of that group's series at once, so
                # ratios (failed / all, misses / all) exist even while one side is 0.
                counter.labels(*labels)
            value = finite(deltas.get(key, 0))
            if value is not None and value > 0:
                counter.labels(*labels).inc(value)

    def sample_queues(self, stats):
        """Set the queue gauges from ``broker.stats(queues)`` (``{queue: QueueStats}``).

        A queue no longer served (a reload took it out of ``broker.queues``)
        loses its series: kept, they would show its last depth for good, and an
        alert on them would never clear.
        """
        for queue in self.sampled_queues - set(stats):
            for gauge in (self.queue_ready, self.queue_scheduled, self.queue_in_flight, self.queue_waiting,
                          self.queue_dead, self.queue_oldest, self.queue_paused):
                try:
                    gauge.remove(queue)
                except KeyError:
                    pass  # never set (a paused flag before the first heartbeat)
        self.sampled_queues = set(stats)
        for queue, s in stats.items():
            self.queue_ready.labels(queue).set(s.ready)
            self.queue_scheduled.labels(queue).set(s.scheduled)
            self.queue_in_flight.labels(queue).set(s.in_flight)
            self.queue_waiting.labels(queue).set(s.waiting)
            self.queue_dead.labels(queue).set(s.dead)
            self.queue_oldest.labels(queue).set(s.oldest_ready_age)
            # Also here, not only when the paused set changes: a queue a reload brings back is paused already.
            self.queue_paused.labels(queue).set(1 if s.paused else 0)
        self.queue_sampled.set(time.time())

    def render(self):
        for flush in self.before_render:
            flush()
        return generate_latest(self.registry).decode()


class JobHistogram:
    """A histogram of seconds by job (queue, type), its counts kept in plain lists.

    Twice a job in the master: prometheus_client's ``Histogram.observe`` takes a
    lock and checks its series on every call (0.7 µs), where a bisect and two
    additions take a fifth of that. Only the main loop observes and renders, so
    nothing here needs a lock. The exposition is prometheus_client's own
    (``HistogramMetricFamily``), the same text as its ``Histogram`` writes.
    """

    def __init__(self, name, documentation, buckets, registry):
        self.name, self.documentation = name, documentation
        self.bounds = tuple(float(b) for b in buckets)
        self.les = [floatToGoString(b) for b in self.bounds] + ["+Inf"]
        self.children = {}  # (queue, type) -> _Buckets: bounded as the labels are (served types)
        registry.register(self)

    def labels(self, queue, job_type):
        child = self.children.get((queue, job_type))
        if child is None:
            child = self.children[(queue, job_type)] = _Buckets(self.bounds)
        return child

    def describe(self):
        return [HistogramMetricFamily(self.name, self.documentation, labels=JOB)]

    def collect(self):
        family = HistogramMetricFamily(self.name, self.documentation, labels=JOB)
        for labels, child in self.children.items():
            total, buckets = 0, []
            for le, n in zip(self.les, child.counts):
                total += n
                buckets.append((le, total))
            family.add_metric(labels, buckets, child.sum)
        yield family


class _Buckets:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # per bucket, not cumulative; the last is +Inf
        self.sum = 0.0

    def observe(self, seconds):
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1  # a bucket holds what is <= its bound
        self.sum += seconds


class _Live:
    """Gauges read from the master's objects at scrape time (cheap: no broker call)."""

    def __init__(self, arbiter):
        self.arbiter = arbiter

    def describe(self):
        return []  # unchecked collector: the names are not known to clash

    def collect(self):
        a = self.arbiter
        states = GaugeMetricFamily("tangguh_workers", "Children by state", labels=["state"])
        counts = dict.fromkeys(("starting", "idle", "busy", "stopping"), 0)
        for c in list(a.pool.children.values()):
            counts[c.state] = counts.get(c.state, 0) + 1
        for state, n in counts.items():
            states.add_metric([state], n)
        yield states
        yield GaugeMetricFamily("tangguh_workers_target", "Children the supervisor aims to keep", value=a.pool.target)
        yield GaugeMetricFamily("tangguh_generation", "Handler/config generation (SIGHUP reloads add one)",
                                value=a.generation)
        yield GaugeMetricFamily("tangguh_broker_up", "1 while the broker answers, 0 while it is down",
                                value=0 if a.link.down else 1)
        yield GaugeMetricFamily("tangguh_prefetched_jobs", "Jobs claimed but not yet handed to a child",
                                value=len(a.dispatcher.prefetched))
        yield GaugeMetricFamily("tangguh_pending_writes", "Outcomes waiting to be stored in the broker",
                                value=len(a.writer))
        hb = a.heartbeat
        yield GaugeMetricFamily("tangguh_heartbeat_lag_seconds", "How late the last lease renewal round started",
                                value=hb.lag)
        yield GaugeMetricFamily("tangguh_heartbeat_age_seconds", "Seconds since the heartbeat thread last ran",
                                value=max(0.0, time.monotonic() - hb.last_beat))
        yield GaugeMetricFamily("tangguh_heartbeat_interval_seconds", "Configured heartbeat interval",
                                value=hb.interval)
        yield GaugeMetricFamily("tangguh_leases_held", "Leases the heartbeat renews", value=len(hb.held))
        yield CounterMetricFamily("tangguh_lease_extensions", "Lease renewals accepted by the broker",
                                  value=hb.extensions)
        yield CounterMetricFamily("tangguh_heartbeat_errors",
                                  "Heartbeat broker calls that failed (renewal, paused queues, record)", value=hb.errors)


# -- HTTP /metrics ---------------------------------------------------------------------

MAX_REQUEST = 8 * 1024
MAX_CLIENTS = 64


def parse_listen(text):
    """``"host:port"`` (or ``"[::1]:port"``) -> (family, (host, port))."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"metrics.listen: expected host:port, got {text!r}")
    host = host.strip("[]") or "0.0.0.0"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return family, (host, int(port))


class HttpExporter(OneShotServer):
    """A tiny HTTP/1.0 responder for ``GET /metrics`` inside the master's selector."""

    max_request = MAX_REQUEST
    terminator_slack = 3  # the first three bytes of "\r\n\r\n"
    max_clients = MAX_CLIENTS
    read_size = 4096

    def __init__(self, listen, selector, render, client_timeout=5.0):
        family, address = parse_listen(listen)
        self.render = render
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(64)
        listener.setblocking(False)
        super().__init__(listener, selector, client_timeout)

    @property
    def address(self):
        host, port = self.listener.getsockname()[:2]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def complete(self, inbox):
        start = len(inbox) - len(inbox.lstrip(b"\r\n"))  # empty lines before the request line (answer)
        ends = [i for i in (inbox.find(b"\r\n\r\n", start), inbox.find(b"\n\n", start)) if i >= 0]
        return min(ends, default=-1)

    def answer(self, request):
        # HTTP/1.1 (RFC 9112, 2.2) has servers skip empty lines before the request line: a client
        # may end the previous request's body with one more CRLF. Read as the line, it was a 400.
        line = request.lstrip(b"\r\n").split(b"\n", 1)[0].decode("latin-1").strip()
        parts = line.split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return _http(400, "bad request\n")
        method, target = parts[0], parts[1].split("?", 1)[0]
        if method not in ("GET", "HEAD"):
            return _http(405, "only GET\n")
        if target == "/metrics":
            try:
                return _http(200, self.render(), CONTENT_TYPE, method == "HEAD")
            except Exception as exc:  # noqa: BLE001 - a collector bug must not take the daemon down
                return _http(500, f"{type(exc).__name__}: {exc}\n")
        if target == "/":
            return _http(200, "tangguh: metrics at /metrics\n")
        return _http(404, "not found (try /metrics)\n")

    def too_large(self):
        return _http(431, "request header too large\n")

    def timed_out(self):
        return _http(408, "timed out waiting for the request\n")


_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 408: "Request Timeout",
            431: "Request Header Fields Too Large", 500: "Internal Server Error"}


def _http(status, body, content_type="text/plain; charset=utf-8", head=False):
    data = body.encode()
    header = (f"HTTP/1.0 {status} {_REASONS[status]}\r\nContent-Type: {content_type}\r\n"
              f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode()
    return header + (b"" if head else data)
