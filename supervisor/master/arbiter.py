"""The master: wires the parts together and runs the loop.

``Arbiter.run`` is the whole life of the master: wait on the selector and
read what is ready (signals via a self-pipe, child pipes, the health socket,
the broker's wake-up fd), then in order handle signals, reap children, act on
what the heartbeat found (lost leases, cancels, pauses), kill overdue
children, write outcomes to the broker, bring the pool to size, claim work and
hand it out, run the periodic chores (schedules, pruning, queue samples) and
report. Nothing blocks but broker calls, bounded by the broker's own
timeouts. docs/design.md draws the parts and the rules.

This is the only module of ``supervisor.master`` that knows the others:

* ``pool``: the children (fork, pipes, reaping, recycling); ``overdue``: their hard timeouts;
* ``dispatch``: claiming, prefetch, handing jobs (batches of short ones) to free children;
* ``prefetch``: how many jobs of each type may wait here, and which may share a batch;
* ``endings``: a child's replies and death, and the jobs queued behind its running one;
* ``verdict``: what becomes of a job when its attempt ends (pure); ``outcomes``: storing those verdicts;
* ``brokerlink``: the main loop's broker connection and outage state;
* ``status``: counters, status JSON, systemd, the process title;
* ``periodic``: schedules, pruning, queue samples;
* ``locks``: the children's Redis locks, from the master's side;
* ``control``: lost leases, cancel requests and paused queues, from the heartbeat;
* ``orphans``: the jobs a claim given up on leased to us anyway, found and released;
* ``reloads``: SIGHUP: the trial import (``trial``) while the loop serves on, then the new generation.
"""
import collections
import logging
import os
import selectors
import signal
import socket
import time

from .. import jobref, protocol, registry, toolkit
from ..child import worker as child  # imported before the forks: the children share it
from ..errors import BrokerBusy, BrokerError, BrokerUnusable, ConfigError
from ..health import AlreadyRunning, HealthServer
from ..heartbeat import Heartbeat
from ..metrics import HttpExporter, Metrics
from ..protocol import KILLED_SHUTDOWN, LEASE_EXPIRED, UNKNOWN_TYPE
from ..retry import next_delay
from ..sdnotify import Notifier
from ..urls import redact
from . import overdue, trial, verdict
from .brokerlink import BrokerLink
from .control import JobControl
from .dispatch import Dispatcher
from .endings import Endings
from .locks import MasterLocks
from .orphans import Orphans, known_job_ids
from .outcomes import OutcomeWriter, attempt_info
from .periodic import Periodic
from .pool import Pool
from .prefetch import Prefetch
from .reloads import Reloads
from .status import Status

log = logging.getLogger("tangguh.arbiter")

EXIT_OK, EXIT_ERROR, EXIT_CONFIG, EXIT_RUNNING, EXIT_BOOT = 0, 1, 2, 3, 4
SETTINGS_CACHE = 1024  # (type, timeout, max_attempts) -> JobSettings of the current generation
held = []  # SIGHUP, TTIN, TTOU that came while the handlers imported (master.run): acted on in start()


class Arbiter:
    def __init__(self, cfg, handlers):
        self.cfg = cfg
        self.handlers = handlers
        self.generation = 1
        self.settings_cache = {}
        self.pid = os.getpid()
        # Unique even between two masters with one host name and one pid (containers on the host's
        # network, each master PID 1): a look for orphans (orphans.py) trusts it to name only us.
        self.owner = f"{socket.gethostname()}:{self.pid}:{os.urandom(2).hex()}"
        self.started_at = time.time()
        self.reload_error = None
        self.stopping = None  # None, "graceful", "fast"
        self.stop_deadline = None
        self.exit_code = EXIT_OK
        self.selector = selectors.DefaultSelector()
        self.signals = collections.deque()
        self.exporter = None  # HTTP /metrics, when [metrics] listen is set
        b = cfg.broker
        self.metrics = Metrics(self)
        self.status = Status(self, self.metrics, Notifier())
        count = self.status.count
        # The dispatcher, made below, is told of a wake-up (claim now) and of an outage (claim after its retry).
        self.link = BrokerLink(b.url, b.migrate, self.selector, self.metrics, on_wakeup=lambda queues: self.dispatcher.wake(queues),
                               on_down=lambda retry_at: self.dispatcher.hold_claims_until(retry_at), pid=self.pid)
        # The wake-up pipe is made in start(); the heartbeat only writes to it once started.
        self.heartbeat = Heartbeat(b.url, b.lease_seconds, b.heartbeat_seconds, None, list(b.queues),
                                   self.metrics.sample_queues)
        self.endings, self.reloads = Endings(self), Reloads(self, trial.Trial)
        self.pool = Pool(cfg.supervisor, self.selector, self.heartbeat, run_child=self.run_child,
                         on_reply=self.endings.on_reply, on_lock=self.on_lock, on_exit=self.endings.on_child_exit,
                         on_boot_failed=self.on_boot_failed, count=count)
        self.writer = OutcomeWriter(self.link, unhold=self.heartbeat.drop, on_stored=self.status.stored,
                                    on_lost=lambda job: count("lease_lost"))
        self.dispatcher = Dispatcher(cfg, handlers, self.owner, self.link, self.pool,
                                     Prefetch(b.prefetch, cfg.supervisor.workers), hold=self.heartbeat.hold,
                                     settings_for=self.settings_for, on_claimed=self.status.claimed,
                                     on_unknown=self.on_unknown_type, on_expired=self.status.expired,
                                     give_back=self.writer.release, on_started=self.status.started)
        self.orphans = Orphans(self.link, self.owner, lambda: known_job_ids(self.heartbeat, self.writer,
                                                                            self.dispatcher, self.pool), count)
        self.dispatcher.on_unanswered = self.orphans.claim_unanswered
        self.periodic = Periodic(cfg, handlers, self.link)
        self.control = JobControl(self.heartbeat, self.pool, self.dispatcher, self.writer, self.metrics, count,
                                  lambda job, s: self.settle(job, s, verdict.Ending(cancel_sent=True)),
                                  record=self.status.record, withdraw=self.endings.withdraw)

    # -- life -------------------------------------------------------------------------
    def run(self):
        try:
            self.start()
        except AlreadyRunning as exc:
            log.error("%s", exc)
            return EXIT_RUNNING
        log.info("supervisor started", extra={"event": "start", "pid": self.pid, "generation": self.generation})
        while not self.finished():
            self.wait_and_read()
            self.handle_signals()
            self.reloads.step()  # a trial import whose time ran out
            self.pool.reap()
            self.control.run(self.cfg.broker.queues, stopping=self.stopping is not None)
            overdue.kill_overdue(self.pool)
            self.check_stop_deadline()
            self.writer.flush(stopping=self.stopping is not None)
            self.pool.manage()
            self.withdraw_from_retiring()
            self.claim_and_dispatch()
            self.periodic.run(schedules=self.stopping is None)  # a stopping master enqueues nothing new
            self.status.report()
        self.shutdown()
        return self.exit_code

    def start(self):
        self.health = HealthServer(self.cfg.supervisor.socket, self.cfg.supervisor.socket_mode, self.selector,
                                   self.status.answer, group=self.cfg.supervisor.socket_group)
        self.sig_r, self.sig_w = os.pipe()
        self.wake_r, self.wake_w = os.pipe()
        for fd in (self.sig_r, self.sig_w, self.wake_r, self.wake_w):
            os.set_blocking(fd, False)
        self.selector.register(self.sig_r, selectors.EVENT_READ, self.read_signals)
        self.selector.register(self.wake_r, selectors.EVENT_READ, self.read_wakeups)
        self.catch_signals()
        trial.not_the_masters_in_forks(self.pid, lambda: [s for s in (self.health, self.exporter) if s is not None])
        self.signals.extend(held)  # a SIGHUP during start-up: a reload now
        if self.cfg.metrics.listen:
            try:
                self.exporter = HttpExporter(self.cfg.metrics.listen, self.selector, self.metrics.render)
            except (OSError, ValueError) as exc:
                # Jobs matter more than their metrics: run on, loudly, without the endpoint.
                log.error("metrics endpoint %s not started: %s", self.cfg.metrics.listen, exc,
                          extra={"event": "metrics_failed"})
        # Redis locks the children hold: extended by the heartbeat, released when a child dies.
        self.locks = MasterLocks(self.cfg.toolkit.redis_url) if self.cfg.toolkit.redis_url else None
        self.heartbeat.wake_fd, self.heartbeat.locks = self.wake_w, self.locks
        try:
            # One round trip (Redis connects lazily): a URL the server refuses shows now.
            self.link.call(lambda br: br.now())
        except ConfigError:
            self.health.close()
            raise
        except BrokerError as exc:
            cause = exc.__cause__ or exc.__context__
            if isinstance(cause, BrokerUnusable):
                # Waiting cannot fix a bad option, port, database or login: exit 2, no restart loop.
                self.health.close()
                raise ConfigError("broker.url: " + " ".join(str(cause).split())) from None
            if self.cfg.broker.url.startswith("sqlite:") and not isinstance(cause, BrokerBusy):
                self.health.close()
                raise  # a local file we cannot open is a setup error; one another process holds is an outage
        self.status.set_title()
        toolkit.preload(self.cfg.toolkit)  # before the first fork: the children share the driver, the codec
        self.pool.manage()
        self.heartbeat.start()

    def finished(self):
        return self.stopping is not None and not self.pool.children and self.writer.settled()

    def wait_and_read(self):
        """Sleep until the next due instant or until a descriptor is ready, and read what is."""
        for key, mask in self.selector.select(self.next_wakeup()):
            key.data(mask)
        self.health.expire_clients()
        if self.exporter is not None:
            self.exporter.expire_clients()

    def next_wakeup(self):
        """Seconds until the earliest instant some part needs the loop."""
        now = time.monotonic()
        instants = [now + 1.0, self.writer.due_at(), self.stop_deadline, self.status.notifier.next_ping_at(),
                    self.reloads.due_at()]
        instants.extend(overdue.deadlines(self.pool))
        if self.stopping is None:
            # A WatchdogSec= under 2 s must not expire while we sleep: the ping is in the list.
            instants += [self.dispatcher.due_at(), self.pool.spawn_due_at(), self.periodic.due_at(),
                         self.orphans.due_at()]
        return max(0.0, min(i for i in instants if i is not None) - now)

    def shutdown(self):
        self.heartbeat.close()
        self.health.close()
        if self.exporter is not None:
            self.exporter.close()
        self.link.drop()
        signal.set_wakeup_fd(-1)
        self.status.notifier.close()
        log.info("supervisor stopped", extra={"event": "stop", "pid": self.pid, "exit_code": self.exit_code})

    # -- signals -------------------------------------------------------------------------
    def catch_signals(self):
        """The master's signals: at start, and again after a reload's own import, where a handler
        module may have set its own (SIGCHLD ignored: no child reaped again; SIGTERM at its default
        action: no graceful stop) over the master's, as it did at start-up before these."""
        for sig in trial.SIGNALS:
            signal.signal(sig, lambda *_: None)  # the byte on the self-pipe is all we need
        signal.set_wakeup_fd(self.sig_w)

    def read_signals(self, _mask):
        try:
            data = os.read(self.sig_r, 4096)
        except BlockingIOError:
            return
        self.signals.extend(data)

    def read_wakeups(self, _mask):
        try:
            os.read(self.wake_r, 4096)
        except BlockingIOError:
            pass

    def handle_signals(self):
        while self.signals:
            sig = self.signals.popleft()
            if self.reloads.under_way is not None and sig in (signal.SIGTTIN, signal.SIGTTOU):
                self.reloads.held.append(sig)  # after the reload: its worker count would undo it
                continue
            handler = {
                signal.SIGTERM: self.handle_term, signal.SIGINT: self.handle_term,
                signal.SIGQUIT: self.stop_fast, signal.SIGHUP: self.reloads.request,
                signal.SIGTTIN: lambda: self.resize(+1), signal.SIGTTOU: lambda: self.resize(-1),
            }.get(sig)
            if handler is not None:
                handler()

    def handle_term(self):
        if self.stopping is None:
            self.stop_gracefully()
        else:
            self.stop_fast()  # a second TERM/INT: the operator means it

    def resize(self, by):
        before = self.pool.target
        after = self.pool.resize(by)
        if after == before:  # at the floor or the ceiling: say so, not "lowered to 1" once more
            log.warning("worker count stays at %d, the %s (SIGTT%s ignored)", after, "most" if by > 0 else "least",
                        "IN" if by > 0 else "OU", extra={"event": "ttin" if by > 0 else "ttou"})
            return
        log.info("worker count %s to %d", "raised" if by > 0 else "lowered", after,
                 extra={"event": "ttin" if by > 0 else "ttou"})

    # -- stopping ------------------------------------------------------------------------
    def stop_gracefully(self):
        log.info("graceful stop: finishing running jobs", extra={"event": "stopping"})
        self.begin_stop("graceful")
        self.stop_deadline = time.monotonic() + self.cfg.supervisor.graceful_timeout
        self.pool.retire_all()

    def stop_fast(self):
        log.info("fast stop: killing children", extra={"event": "stopping"})
        self.begin_stop("fast")
        self.stop_deadline = None
        self.pool.kill_all(KILLED_SHUTDOWN)

    def begin_stop(self, how):
        self.reloads.stop()
        self.stopping = how
        self.pool.stopping = True
        self.status.notifier.stopping()
        for job in self.dispatcher.take_all():
            self.writer.release(job)
        for c in self.pool.children.values():
            self.endings.withdraw(c)  # the jobs of a batch not started yet: released at once

    def check_stop_deadline(self):
        if self.stopping == "graceful" and self.stop_deadline is not None and time.monotonic() >= self.stop_deadline:
            log.warning("graceful timeout passed: killing the remaining children", extra={"event": "stopping"})
            self.stop_deadline = None
            self.pool.kill_all(KILLED_SHUTDOWN)

    def on_boot_failed(self):
        self.exit_code = EXIT_BOOT
        self.stop_fast()

    # -- children ----------------------------------------------------------------------------
    def run_child(self, sock, slot, cpu):
        """In a fresh child: close the master's descriptors, then serve jobs (never returns)."""
        self.health.close_in_child()
        if self.exporter is not None:
            self.exporter.close_in_child()
        for fd in (self.sig_r, self.sig_w, self.wake_r, self.wake_w, *self.reloads.fds()):
            os.close(fd)
        self.link.close_in_child()
        self.selector.close()
        self.status.notifier.close()
        toolkit.configure(self.cfg.toolkit, lock_floor=self.cfg.broker.lease_seconds)  # locks outlive a beat
        jobref.configure_unless_set(self.cfg)  # a handler's follow-up .enqueue() goes to our broker
        child.main(sock, slot, self.handlers, self.pid, cpu)

    def on_lock(self, c, msg):
        if self.locks is not None:
            self.locks.on_message(c.pid, msg)

    # -- jobs ----------------------------------------------------------------------------------
    def settings_for(self, job):
        # Cached per generation: they depend only on the config, the handlers and these job fields.
        key = (job.type, job.timeout, job.max_attempts)
        settings = self.settings_cache.get(key)
        if settings is None:
            if len(self.settings_cache) >= SETTINGS_CACHE:
                self.settings_cache.clear()  # producers choose types: bounded, not grown
            settings = self.settings_cache[key] = registry.job_settings(self.cfg, self.handlers, job)
        return settings

    def backoff(self, failures):
        j = self.cfg.jobs
        return next_delay(failures, j.backoff_base, j.backoff_cap, j.jitter)

    def judge_child(self, job, settings, c, reply=None, how=None, cancel_sent=False):
        """Settle the attempt ``c`` ran: from its reply, or from ``how`` it died."""
        if reply is not None:
            ending = verdict.Ending(reply=reply, kill_reason=c.kill_reason, term_sent=c.term_at is not None,
                                    cancel_sent=cancel_sent)
        else:
            ending = verdict.Ending(exit_how=how, kill_reason=c.kill_reason, bad_frame=str(c.bad_frame or ""),
                                    too_large=isinstance(c.bad_frame, protocol.TooLarge), cancel_sent=cancel_sent)
        self.settle(job, settings, ending, c, reply)

    def settle(self, job, settings, ending, c=None, reply=None):
        """Judge an ended attempt, count it, and queue its outcome for the broker."""
        outcome = verdict.judge(job.attempt, settings.max_attempts, ending, self.backoff)
        self.status.outcome(job, outcome, (reply or {}).get("duration", 0))
        self.writer.add(job, outcome, attempt_info(c, reply, settings.max_attempts))

    def on_unknown_type(self, job, settings):
        """A claimed job no child runs: no handler takes its type, or it is ``past_attempts``."""
        if job.type in self.handlers:
            outcome = verdict.failure(job.attempt, settings.max_attempts, LEASE_EXPIRED, "",
                                      f"attempt {job.attempt} is past the {settings.max_attempts} attempt(s) its type"
                                      f" allows; the lease of attempt {job.attempt - 1} expired", self.backoff)
        else:
            outcome = verdict.failure(job.attempt, settings.max_attempts, UNKNOWN_TYPE, "UnknownType",
                                      f"no handler for job type {job.type!r}", self.backoff)
        self.status.outcome(job, outcome)
        self.writer.add(job, outcome, attempt_info(max_attempts=settings.max_attempts))

    def withdraw_from_retiring(self):
        """A child told to exit after its current job (a reload, fewer workers) starts no other:
        the jobs queued behind that one go back now, not after a job that may run long, nor
        under the old generation's handlers."""
        for c in list(self.pool.children.values()):
            if c.retiring and c.queued:
                self.endings.withdraw(c)

    def claim_and_dispatch(self):
        if self.stopping is not None:
            return
        self.dispatcher.dispatch()
        self.orphans.run(self.cfg.broker)  # before a claim could lease them again
        self.dispatcher.claim()
        self.control.handle_lost_leases()  # a claim may retake a job of ours: its old attempt goes first
        self.dispatcher.dispatch()

    @property
    def broker_shown(self):
        return redact(self.cfg.broker.url)

