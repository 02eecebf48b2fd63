"""What the master tells the world: counters, the status JSON, systemd, the process title.

Every event is counted once, through ``count(event)``, which moves both the
status counters (``tangguh status``) and the Prometheus series: the two can
never disagree. A job's counters move at the next render (``flush``), in one
call per series, not in two calls per job. The status reporter reads the master's parts; it changes none.
"""
import logging
import os
import socket
import time

import psutil
import setproctitle

from .. import __version__, logs
from ..model import ACK, CANCELLED, DEAD, MAX_ERROR_MESSAGE, RETRY, clip_start
from ..protocol import TIMEOUT

log = logging.getLogger("tangguh.arbiter")

STATUS_SECONDS = 1.0  # the least time between two STATUS= texts to systemd
COUNTERS = ("succeeded", "failed", "retried", "dead", "timeouts", "crashed", "lease_lost", "duplicates_suppressed",
            "cancelled", "expired")

# event -> (status counter or None, Metrics attribute, fixed labels). Job events
# get the job's (queue, type) labels first; the caller adds the rest (a reason).
EVENTS = {
    "claimed": (None, "claimed", ()),
    "lease_expired": (None, "lease_expiries", ()),
    "orphan_released": (None, "orphans_released", ()),
    "succeeded": ("succeeded", "succeeded", ()),
    "failed": ("failed", "failed", ()),
    "timeout": ("timeouts", "timeouts", ()),
    "retried": ("retried", "retried", ()),
    "dead": ("dead", "dead", ()),
    "lease_lost": ("lease_lost", "leases_lost", ()),
    "crashed_mid_job": ("crashed", "crashed", ("mid_job",)),  # the status counter counts only these
    "crashed_idle": (None, "crashed", ("idle",)),
    "crashed_boot": (None, "crashed", ("boot",)),
    "spawned": (None, "spawned", ()),
    "spawn_failed": (None, "spawn_failures", ()),
    "restarted": (None, "restarted", ()),
    "recycled": (None, "recycled", ()),
    "reload": (None, "reloads", ()),
    "cancelled": ("cancelled", "cancelled", ()),  # labelled by type only (expired jobs come without a queue)
    "expired": ("expired", "expired", ()),
}


def _after_lost_lease(job):
    """The broker reclaims an expired lease inside claim and closes that attempt as
    "lease_expired": seen here as the entry before the new one. An entry a hand-edited
    record holds may be anything: only an object can say so."""
    before = job.history[-2] if len(job.history) >= 2 else None
    return isinstance(before, dict) and before.get("outcome") == "lease_expired"


class Status:
    def __init__(self, master, metrics, notifier):
        self.master = master  # the wiring: read, never changed
        self.metrics = metrics
        self.notifier = notifier
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.ready_sent = False  # READY=1 goes out once the first children are up
        self.status_due = 0.0  # monotonic instant the next STATUS= may go out
        # (Metrics attribute, labels) -> the labelled child: prometheus_client's labels()
        # costs a lock and a tuple check per call. Bounded: the labels are served types
        # (type_label), queues and a fixed set of reasons.
        self.series = {}
        # A job's counts wait here until the next render: each is a plain dict entry, where
        # prometheus_client's Counter.inc takes a lock and checks its series every time, twice
        # a job. Keyed by the type's label as it was when counted (a reload that starts serving
        # a type changes its label from then on), so bounded like ``series``.
        self.tally = {}  # (event, queue, type label, labels) -> count
        metrics.before_render.append(self.flush)

    # -- counting --------------------------------------------------------------------------
    def count(self, event, *labels, job=None, n=1):
        if job is not None:
            key = (event, job.queue, self.metrics.type_label(job.type), labels)
            tally = self.tally
            tally[key] = tally.get(key, 0) + n
            counter = EVENTS[event][0]
        else:
            counter, attribute, fixed = EVENTS[event]
            self._series(attribute, (*labels, *fixed)).inc(n)
        if counter is not None:
            self.counters[counter] += n

    def _observe(self, name, job, seconds):
        """A value for histogram ``name`` (a ``JobHistogram``: no lock, no deferral needed) of ``job``'s series."""
        self._series(name, (job.queue, self.metrics.type_label(job.type))).observe(seconds)

    def flush(self):
        """Move the job counters by what was counted since the last flush: before every render."""
        for (event, queue, label, labels), n in self.tally.items():
            _, attribute, fixed = EVENTS[event]
            self._series(attribute, (queue, label, *labels, *fixed)).inc(n)
        self.tally.clear()

    def _series(self, attribute, labels):
        series = self.series.get((attribute, labels))
        if series is None:
            metric = getattr(self.metrics, attribute)
            series = self.series[(attribute, labels)] = metric.labels(*labels) if labels else metric
        return series

    def claimed(self, job):
        if log.isEnabledFor(logging.DEBUG):  # the fields cost more than a discarded record
            log.debug("job claimed", extra=logs.job_fields(job, event="claim",
                                                           reason="lease_expired" if _after_lost_lease(job) else None))

    def started(self, job):
        """An attempt starts: counted here, not at its claim, which a job handed back unstarted
        (its attempt and history entry taken back by the broker) makes again."""
        self.count("claimed", job=job)
        if _after_lost_lease(job):
            self.count("lease_expired", job=job)

    def attempt(self, job, reply):
        """Metrics of one finished attempt: its duration and the child's counter deltas."""
        duration = reply.get("duration")
        if isinstance(duration, (int, float)):
            self._observe("duration", job, duration)
        deltas = reply.get("metrics")
        if not deltas or not isinstance(deltas, dict):
            return  # most jobs use no lock, no cache and no idempotency key: nothing to add
        if isinstance(deltas.get("duplicates_suppressed"), int):
            self.counters["duplicates_suppressed"] += deltas["duplicates_suppressed"]
        self.metrics.child_deltas(job, deltas)  # the Prometheus side of the same deltas
        if deltas.get("lock_failed"):
            # The metric is per type; this record names the contended resource.
            log.info("lock contention: %s failed acquisitions", deltas["lock_failed"],
                     extra=logs.job_fields(job, event="lock_contention"))

    def expired(self, job_type):
        self.count("expired", self.metrics.type_label(job_type))

    def outcome(self, job, outcome, duration=0):
        """Count and log a verdict (``model.Outcome``) before it is stored."""
        if outcome.op == CANCELLED:
            self.count("cancelled", self.metrics.type_label(job.type))
            request = job.cancel_request if isinstance(job.cancel_request, dict) else {}
            if isinstance(request.get("at"), (int, float)):  # the broker's clock wrote it: close enough
                self.metrics.cancel_latency.observe(max(0.0, time.time() - request["at"]))
            log.info("job cancelled", extra=logs.job_fields(job, event="cancelled", by=request.get("by"),
                                                            reason=request.get("reason")))
            return
        if outcome.op == ACK:
            self.count("succeeded", job=job)
            # At DEBUG: a line per job was a tenth of the master's time at full speed.
            # Failures, retries and dead letters stay at INFO and above.
            if log.isEnabledFor(logging.DEBUG):
                log.debug("job done in %.3fs", duration, extra=logs.job_fields(job, event="done"))
            return
        if not outcome.failed:
            return
        self.count("failed", outcome.reason, job=job)
        if outcome.kind == TIMEOUT:
            self.count("timeout", "hard" if outcome.hard_timeout else "soft", job=job)
        error = clip_start(f"{outcome.error_class}: {outcome.message}", MAX_ERROR_MESSAGE)  # one log line, bounded
        fields = logs.job_fields(job, reason=outcome.reason, error=error)
        if outcome.op == DEAD:
            self.count("dead", outcome.reason, job=job)
            log.warning("job dead-lettered (%s)", outcome.reason, extra=dict(fields, event="dead"))
        elif outcome.op == RETRY:
            self.count("retried", outcome.reason, job=job)
            log.info("job failed (%s), retry in %.2fs", outcome.reason, outcome.delay,
                     extra=dict(fields, event="retry", delay=outcome.delay))

    def stored(self, write):
        queued_at = write.job.queued_at
        # A number unless a hand-edited record holds text there: a metric is not worth a job.
        if write.op == ACK and queued_at and type(queued_at) in (float, int):
            waited = max(0.0, time.time() - queued_at)  # the broker's clock set queued_at: close enough
            self._observe("complete", write.job, waited)

    # -- reporting ---------------------------------------------------------------------------
    def set_title(self):
        m = self.master
        setproctitle.setproctitle(f"tangguh: master [{m.cfg.path or 'defaults'}] gen {m.generation}")

    def summary(self):
        m = self.master
        busy = sum(1 for c in m.pool.children.values() if c.state == "busy")
        c = self.counters
        text = (f"gen {m.generation}: {len(m.pool.children)} workers, {busy} busy; "
                f"{c['succeeded']} done, {c['retried']} retried, {c['dead']} dead")
        if m.link.down:
            text += "; BROKER DOWN"
        if m.reload_error:
            text += "; last reload failed"
        if m.pool.spawn_failures:
            text += f"; forks refused: {len(m.pool.live())} of {m.pool.target} workers"
        return text

    def report(self):
        """Tell systemd how we are: READY once, STATUS on change, WATCHDOG while the loop turns."""
        m = self.master
        if not self.notifier.enabled:
            return  # not under systemd (or no NOTIFY_SOCKET): nothing to tell, nothing to build
        if not self.ready_sent and m.stopping is None and m.pool.all_started():
            self.ready_sent = True
            self.notifier.ready(self.summary())
        now = time.monotonic()
        if now >= self.status_due:
            # At most once a second: the text changes with every job done, and a
            # datagram per loop turn would cost a syscall for every few jobs.
            self.status_due = now + STATUS_SECONDS
            self.notifier.status(self.summary())
        # Pings prove the loop turns, nothing more: a wedged loop stops them.
        # A broker outage does not (STATUS says BROKER DOWN): a restart by the
        # watchdog would kill running jobs and could not bring the broker back.
        self.notifier.watchdog()

    def reloaded(self):
        """After a reload, good or bad: the old or new generation serves."""
        # Before the first READY, report() sends it once the children are up.
        if self.ready_sent:
            self.notifier.ready(self.summary())

    def answer(self, req):
        """A health-socket request -> its reply."""
        cmd = req["cmd"]
        if cmd == "ping":
            return {"ok": True, "pong": True, "pid": self.master.pid}
        if cmd == "status":
            return self.view()
        if cmd == "metrics":
            return {"ok": True, "text": self.metrics.render()}
        return {"ok": False, "error": f"unknown command {cmd!r} (try ping, status, metrics)"}

    def view(self):
        m = self.master
        return {
            "ok": True, "pid": m.pid, "started_at": m.started_at, "generation": m.generation,
            "version": __version__,
            "config": m.cfg.path, "broker": m.broker_shown, "reload_error": m.reload_error,
            "stopping": m.stopping, "broker_down": m.link.down,
            "target_workers": m.pool.target, "prefetched": len(m.dispatcher.prefetched),
            "prefetch": m.dispatcher.prefetch.view(),
            "pending_writes": len(m.writer),
            "workers": [child_view(c) for c in sorted(m.pool.children.values(), key=lambda c: c.slot)],
            "restarts": m.pool.restarts, "counters": dict(self.counters), "empty_polls": m.dispatcher.empty_polls,
            "orphans_released": m.orphans.released, "claims_unanswered": m.orphans.unanswered,
            "handlers": sorted(m.handlers),
            "queues": {q: s.to_dict() for q, s in m.heartbeat.queue_stats.items()},
            "queues_sampled_ago": sampled_ago(m.heartbeat), "queues_sample_failing": m.heartbeat.sample_failing,
            "paused_queues": sorted(m.control.paused or ()),
            "metrics_listen": m.exporter.address if m.exporter is not None else None,
        }

    def record(self):
        """This supervisor's record in the broker (``tangguh supervisors``), written by the heartbeat."""
        m = self.master
        workers = [{k: v[k] for k in ("slot", "pid", "state", "job_id", "job_type", "elapsed", "progress")}
                   for v in self.view()["workers"]]
        return {"id": m.owner, "host": socket.gethostname(), "pid": m.pid, "version": __version__,
                "started": m.started_at, "config": m.cfg.path, "queues": list(m.cfg.broker.queues),
                "paused_queues": sorted(m.control.paused or ()), "workers": workers, "counters": dict(self.counters)}


def sampled_ago(heartbeat):
    """Seconds since the queue counts were sampled (None: never yet)."""
    at = heartbeat.sampled_at
    return None if at is None else round(time.monotonic() - at, 1)


def child_view(c):
    """One child (``pool.Child``) as ``status`` shows it."""
    elapsed = None if c.started is None or c.job is None else round(time.monotonic() - c.started, 3)
    try:
        rss = psutil.Process(c.pid).memory_info().rss
    except (psutil.Error, OSError):  # gone, or no descriptor left to read /proc with
        rss = None
    try:
        cpus = sorted(os.sched_getaffinity(c.pid))
    except (AttributeError, OSError):  # not Linux, or gone
        cpus = None
    return {"slot": c.slot, "pid": c.pid, "state": c.state,
            "job_id": c.job.id if c.job else None, "job_type": c.job.type if c.job else None,
            "attempt": c.job.attempt if c.job else None, "elapsed": elapsed, "queued": len(c.queued),
            "rss_bytes": rss, "cpus": cpus, "jobs_done": c.jobs_done, "generation": c.generation,
            "progress": c.progress[0] if c.progress else None,
            "progress_note": c.progress[1] if c.progress else None, "cancelling": c.cancel_at is not None}
