"""The master: claims jobs, feeds children, applies outcomes, keeps the pool whole.

``Arbiter.run`` is the whole life of the master: wait on the selector (signals
via a self-pipe, child pipes, the health socket, the broker's wake-up fd),
then in order handle signals, reap children, act on lost leases, kill
overdue children, write outcomes to the broker, bring the pool to size, and
claim work for idle children. Nothing blocks except broker calls, and those
are bounded by the broker's own timeouts.
"""
import collections
import logging
import os
import random
import selectors
import signal
import socket
import sys
import time
import traceback

import psutil
import setproctitle

from . import child, config, logs, protocol, registry, scheduler, toolkit
from .metrics import SAMPLE_SECONDS, HttpExporter, Metrics
from .backends import open_broker
from .errors import BrokerError, BrokerUnusable, ConfigError, LeaseLost, TangguhError
from .health import AlreadyRunning, HealthServer
from .heartbeat import Heartbeat
from .locks import MasterLocks
from .sdnotify import Notifier
from .model import REASONS, error_info
from .retry import backoff, next_delay
from .urls import redact
from . import __version__

log = logging.getLogger("tangguh.arbiter")

EXIT_OK, EXIT_ERROR, EXIT_CONFIG, EXIT_RUNNING, EXIT_BOOT = 0, 1, 2, 3, 4
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGHUP, signal.SIGTTIN, signal.SIGTTOU,
           signal.SIGCHLD)
STOP_WRITES_SECONDS = 10.0  # how long a stopping master keeps retrying unstored outcomes
# An ack waits this long for others to share its round trip (and its commit, on SQLite).
# Delaying an ack is safe: the effect is durable already and the lease is still renewed.
ACK_LINGER = 0.005
WRITE_OPS = ("ack", "retry", "dead", "release")  # outcome writes: retried on their own, see call()
COUNTERS = ("succeeded", "failed", "retried", "dead", "timeouts", "crashed", "lease_lost", "duplicates_suppressed")


class Worker:
    """The master's record of one child."""

    def __init__(self, slot, pid, sock, generation):
        self.slot, self.pid, self.sock, self.generation = slot, pid, sock, generation
        self.reader = protocol.Reader()
        self.state = "starting"  # starting, idle, busy, stopping
        self.job = None
        self.started = None  # monotonic start of the current job
        self.deadline = None  # monotonic hard-timeout instant
        self.term_at = None  # when SIGTERM was sent (hard timeout grace)
        self.kill_reason = None  # "timeout", "lease_lost", "shutdown": why we killed it
        self.jobs_done = 0
        self.retiring = False
        self.bad_frame = None  # the error of a message the protocol cannot take: no more reading

    def view(self):
        elapsed = None if self.started is None or self.job is None else round(time.monotonic() - self.started, 3)
        try:
            rss = psutil.Process(self.pid).memory_info().rss
        except psutil.Error:
            rss = None
        return {"slot": self.slot, "pid": self.pid, "state": self.state,
                "job_id": self.job.id if self.job else None, "job_type": self.job.type if self.job else None,
                "attempt": self.job.attempt if self.job else None, "elapsed": elapsed, "rss_bytes": rss,
                "jobs_done": self.jobs_done, "generation": self.generation}


class Write:
    """An outcome to store in the broker, retried with backoff while the broker is down."""

    def __init__(self, job, op, args):
        self.job, self.op, self.args = job, op, args
        self.tries = 0
        self.next_at = 0.0


class Arbiter:
    def __init__(self, cfg, handlers):
        self.cfg = cfg
        self.handlers = handlers
        self.generation = 1
        self.target = cfg.supervisor.workers
        self.pid = os.getpid()
        self.owner = f"{socket.gethostname()}:{self.pid}"
        self.started_at = time.time()
        self.workers = {}  # pid -> Worker
        self.prefetched = collections.deque()
        self.writes = collections.deque()
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.restarts = 0
        self.reload_error = None
        self.stopping = None  # None, "graceful", "fast"
        self.stop_deadline = None
        self.give_up_writes_at = None
        self.exit_code = EXIT_OK
        self.boot_failures = 0
        self.next_spawn_at = 0.0
        self.next_claim_at = 0.0
        self.empty_claims = 0  # empty claims in a row: the idle backoff
        self.empty_polls = 0  # empty claims since start, for status
        self.broker = None
        self.broker_fd = None
        self.broker_down_since = None
        self.broker_retry = 0
        self.next_prune_at = time.monotonic() + 60
        self.selector = selectors.DefaultSelector()
        self.signals = collections.deque()
        self.notifier = Notifier()
        self.ready_sent = False  # READY=1 goes out once the first children are up
        self.plan_scheduling()
        self.metrics = Metrics(self)
        self.exporter = None  # HTTP /metrics, when [metrics] listen is set
        self.queue_stats = {}  # the last broker.stats() sample: {queue: QueueStats}
        self.next_sample_at = 0.0

    # -- life -------------------------------------------------------------------
    def run(self):
        try:
            self.start()
        except AlreadyRunning as exc:
            log.error("%s", exc)
            return EXIT_RUNNING
        log.info("supervisor started", extra={"event": "start", "pid": self.pid, "generation": self.generation})
        while not self.finished():
            self.sleep()
            self.handle_signals()
            self.reap_workers()
            self.handle_lost_leases()
            self.murder_workers()
            self.flush_writes()
            self.manage_workers()
            self.claim_jobs()
            self.run_schedules()
            self.housekeeping()
            self.report()
        self.shutdown()
        return self.exit_code

    def start(self):
        self.health = HealthServer(self.cfg.supervisor.socket, self.cfg.supervisor.socket_mode, self.selector,
                                   self.answer, group=self.cfg.supervisor.socket_group)
        self.sig_r, self.sig_w = os.pipe()
        self.wake_r, self.wake_w = os.pipe()
        for fd in (self.sig_r, self.sig_w, self.wake_r, self.wake_w):
            os.set_blocking(fd, False)
        self.selector.register(self.sig_r, selectors.EVENT_READ, self._on_signal_bytes)
        self.selector.register(self.wake_r, selectors.EVENT_READ, self._on_wake)
        for sig in SIGNALS:
            signal.signal(sig, lambda *_: None)  # the byte on the self-pipe is all we need
        signal.set_wakeup_fd(self.sig_w)
        if self.cfg.metrics.listen:
            try:
                self.exporter = HttpExporter(self.cfg.metrics.listen, self.selector, self.metrics.render)
            except (OSError, ValueError) as exc:
                # Jobs matter more than their metrics: run on, loudly, without the endpoint.
                log.error("metrics endpoint %s not started: %s", self.cfg.metrics.listen, exc,
                          extra={"event": "metrics_failed"})
        b = self.cfg.broker
        self.heartbeat = Heartbeat(b.url, b.lease_seconds, b.heartbeat_seconds, self.wake_w)
        # Redis locks the children hold: extended by the heartbeat, released when a child dies.
        self.locks = MasterLocks(self.cfg.toolkit.redis_url) if self.cfg.toolkit.redis_url else None
        self.heartbeat.locks = self.locks
        try:
            # One round trip (Redis connects lazily): a URL the server refuses shows now.
            self.call(lambda br: br.now())
        except ConfigError:
            self.health.close()
            raise
        except BrokerError as exc:
            cause = exc.__cause__ or exc.__context__
            if isinstance(cause, BrokerUnusable):
                # Waiting cannot fix a bad option, port, database or login: exit 2, no restart loop.
                self.health.close()
                raise ConfigError("broker.url: " + " ".join(str(cause).split())) from None
            if self.cfg.broker.url.startswith("sqlite:"):
                self.health.close()
                raise  # a local file we cannot open is a setup error, not an outage
        self.set_title()
        self.manage_workers()
        self.heartbeat.start()

    def finished(self):
        if self.stopping is None or self.workers:
            return False
        if not self.writes:
            return True
        # Outcomes the broker would not take: give up after a while rather than
        # hang the stop. Their leases expire and the jobs run again.
        now = time.monotonic()
        if self.give_up_writes_at is None:
            self.give_up_writes_at = now + STOP_WRITES_SECONDS
        if now < self.give_up_writes_at:
            return False
        log.error("stopping with %d outcomes not stored; those jobs will run again after their lease",
                  len(self.writes), extra={"event": "writes_abandoned"})
        return True

    def sleep(self):
        for key, mask in self.selector.select(self.next_wakeup()):
            key.data(mask)
        self.health.expire_clients()
        if self.exporter is not None:
            self.exporter.expire_clients()

    def next_wakeup(self):
        now = time.monotonic()
        instants = [now + 1.0]
        if self.stopping is None and self.capacity() > 0:
            instants.append(self.next_claim_at)
        for w in self.workers.values():
            if w.deadline is not None:
                instants.append(w.term_at + self.cfg.supervisor.kill_grace if w.term_at else w.deadline)
        instants.extend(w.next_at for w in self.writes)
        if self.stop_deadline is not None:
            instants.append(self.stop_deadline)
        if self.stopping is None and self.scheduler.schedules:
            instants.append(self.schedule_at)
        if self.stopping is None and self.missing_workers() > 0:
            instants.append(self.next_spawn_at)
        ping_at = self.notifier.next_ping_at()
        if ping_at is not None:
            instants.append(ping_at)  # a WatchdogSec= under 2 s must not expire while we sleep
        return max(0.0, min(instants) - now)

    def report(self):
        """Tell systemd how we are: READY once, STATUS on change, WATCHDOG while the loop turns."""
        if not self.ready_sent and self.stopping is None and self.missing_workers() <= 0 and all(
                w.state != "starting" for w in self.workers.values()):
            self.ready_sent = True
            self.notifier.ready(self.summary())
        self.notifier.status(self.summary())
        # Pings prove the loop turns, nothing more: a wedged loop stops them.
        # A broker outage does not (STATUS says BROKER DOWN): a restart by the
        # watchdog would kill running jobs and could not bring the broker back.
        self.notifier.watchdog()

    def summary(self):
        busy = sum(1 for w in self.workers.values() if w.state == "busy")
        c = self.counters
        text = (f"gen {self.generation}: {len(self.workers)} workers, {busy} busy; "
                f"{c['succeeded']} done, {c['retried']} retried, {c['dead']} dead")
        if self.broker_down_since is not None:
            text += "; BROKER DOWN"
        if self.reload_error:
            text += "; last reload failed"
        return text

    def shutdown(self):
        self.heartbeat.close()
        self.health.close()
        if self.exporter is not None:
            self.exporter.close()
        self.drop_broker()
        signal.set_wakeup_fd(-1)
        self.notifier.close()
        log.info("supervisor stopped", extra={"event": "stop", "pid": self.pid, "exit_code": self.exit_code})

    # -- signals ------------------------------------------------------------------
    def _on_signal_bytes(self, _mask):
        try:
            data = os.read(self.sig_r, 4096)
        except BlockingIOError:
            return
        self.signals.extend(data)

    def _on_wake(self, _mask):
        try:
            os.read(self.wake_r, 4096)
        except BlockingIOError:
            pass

    def handle_signals(self):
        while self.signals:
            sig = self.signals.popleft()
            handler = {
                signal.SIGTERM: self.handle_term, signal.SIGINT: self.handle_term,
                signal.SIGQUIT: self.handle_quit, signal.SIGHUP: self.reload,
                signal.SIGTTIN: self.handle_ttin, signal.SIGTTOU: self.handle_ttou,
            }.get(sig)
            if handler is not None:
                handler()

    def handle_term(self):
        if self.stopping is None:
            self.stop_gracefully()
        else:
            self.stop_fast()  # a second TERM/INT: the operator means it

    def handle_quit(self):
        self.stop_fast()

    def handle_ttin(self):
        self.target += 1
        log.info("worker count raised to %d", self.target, extra={"event": "ttin"})

    def handle_ttou(self):
        if self.target > 1:
            self.target -= 1
        log.info("worker count lowered to %d", self.target, extra={"event": "ttou"})

    def stop_gracefully(self):
        log.info("graceful stop: finishing running jobs", extra={"event": "stopping"})
        self.stopping = "graceful"
        self.notifier.stopping()
        self.stop_deadline = time.monotonic() + self.cfg.supervisor.graceful_timeout
        self.release_prefetched()
        for w in self.workers.values():
            self.retire(w)

    def stop_fast(self):
        log.info("fast stop: killing children", extra={"event": "stopping"})
        self.stopping = "fast"
        self.notifier.stopping()
        self.stop_deadline = None
        self.release_prefetched()
        for w in self.workers.values():
            self.kill_worker(w, "shutdown")

    def release_prefetched(self):
        while self.prefetched:
            job = self.prefetched.popleft()
            self.writes.append(Write(job, "release", ()))

    # -- reload ---------------------------------------------------------------------
    def reload(self):
        if self.stopping:
            return
        self.notifier.reloading()
        try:
            self.load_generation()
        finally:
            # Also after a failed reload: the old generation serves. Before the
            # first READY, report() sends it once the children are up.
            if self.ready_sent:
                self.notifier.ready(self.summary())

    def load_generation(self):
        try:
            cfg = config.load(self.cfg.path)
            if cfg.broker.url != self.cfg.broker.url:
                raise ConfigError("broker.url: changing the broker needs a restart, not a reload")
            if cfg.toolkit.redis_url != self.cfg.toolkit.redis_url:
                # The master extends and releases the children's locks on this Redis.
                raise ConfigError("toolkit.redis_url: changing it needs a restart, not a reload")
            handlers = registry.load_handlers(cfg.supervisor.handlers, self.generation + 1)
        except TangguhError as exc:
            self.reload_error = str(exc)
            self.metrics.reloads.labels("failed").inc()
            log.error("reload failed, keeping generation %d: %s", self.generation, exc,
                      extra={"event": "reload_failed", "generation": self.generation})
            return
        self.cfg, self.handlers = cfg, handlers
        self.plan_scheduling()
        self.generation += 1
        self.target = cfg.supervisor.workers
        self.reload_error = None
        self.heartbeat.lease_seconds = cfg.broker.lease_seconds
        self.heartbeat.interval = cfg.broker.heartbeat_seconds
        logging.getLogger().setLevel(cfg.log.level.upper())
        for w in self.workers.values():
            if w.generation < self.generation:
                self.retire(w)
        self.set_title()
        self.metrics.reloads.labels("ok").inc()
        log.info("reloaded: generation %d with %d handler types", self.generation, len(handlers),
                 extra={"event": "reload", "generation": self.generation})

    # -- children ------------------------------------------------------------------
    def missing_workers(self):
        live = [w for w in self.workers.values() if w.generation == self.generation and not w.retiring]
        return self.target - len(live)

    def manage_workers(self):
        if self.stopping is not None:
            return
        missing = self.missing_workers()
        if missing > 0 and time.monotonic() >= self.next_spawn_at:
            self.spawn_workers(missing)
        elif missing < 0:
            live = [w for w in self.workers.values() if w.generation == self.generation and not w.retiring]
            order = {"starting": 0, "idle": 1, "busy": 2}
            for w in sorted(live, key=lambda w: (order.get(w.state, 3), -w.slot))[:-missing]:
                self.retire(w)

    def spawn_workers(self, n):
        # Fork only while no other thread runs (DESIGN.md, process-model rules).
        running = self.heartbeat.thread is not None
        self.heartbeat.stop()
        try:
            for _ in range(n):
                self.spawn_worker()
        finally:
            if running:
                self.heartbeat.start()

    def spawn_worker(self):
        used = {w.slot for w in self.workers.values()}
        slot = next(i for i in range(len(used) + 1) if i not in used)
        parent_sock, child_sock = socket.socketpair()
        pid = os.fork()
        if pid == 0:
            # From here on this is the child: whatever happens, it must never
            # return into the master's loop.
            try:
                parent_sock.close()
                self.close_in_child()
                toolkit.configure(self.cfg.toolkit)  # the child opens its own connections, lazily
                child.main(child_sock, slot, self.handlers, self.pid)  # never returns
            except BaseException:  # noqa: BLE001 - shown in the log; the master counts a boot failure
                traceback.print_exc()
            finally:
                os._exit(1)
        child_sock.close()
        parent_sock.settimeout(5.0)
        worker = Worker(slot, pid, parent_sock, self.generation)
        self.workers[pid] = worker
        self.selector.register(parent_sock, selectors.EVENT_READ, lambda mask, w=worker: self._on_child(w))
        self.metrics.spawned.inc()
        log.info("spawned worker %d", slot, extra={"event": "spawn", "slot": slot, "pid": pid,
                                                   "generation": self.generation})

    def close_in_child(self):
        """Close the master's descriptors in a fresh child (they belong to the master)."""
        self.health.close_in_child()
        if self.exporter is not None:
            self.exporter.close_in_child()
        for w in self.workers.values():
            w.sock.close()
        for fd in (self.sig_r, self.sig_w, self.wake_r, self.wake_w):
            os.close(fd)
        if self.broker_fd is not None:
            os.close(self.broker_fd)  # our dup: it would keep the broker's socket alive
        self.selector.close()
        self.notifier.close()

    def retire(self, w):
        """Ask a child to exit after its current job (at once when idle)."""
        w.retiring = True
        if w.state != "busy":
            self.send_stop(w)

    def send_stop(self, w):
        w.state = "stopping"
        try:
            protocol.send(w.sock, {"op": "stop"})
        except OSError:
            pass  # already gone: reaping will account for it

    def kill_worker(self, w, reason, sig=signal.SIGKILL):
        if w.kill_reason is None or reason == "lease_lost":
            w.kill_reason = reason
        try:
            os.kill(w.pid, sig)
        except ProcessLookupError:
            pass

    def _on_child(self, w):
        try:
            data = w.sock.recv(65536)
        except (BlockingIOError, InterruptedError, socket.timeout):
            return
        except OSError:
            data = b""
        if not data:
            try:
                self.selector.unregister(w.sock)  # EOF: the child is gone; reaping does the rest
            except (KeyError, ValueError):
                pass
            return
        for msg in self.read_messages(w, data):
            if msg["op"] == "ready":
                w.state = "idle" if w.state == "starting" else w.state
                self.boot_failures = 0
            elif msg["op"] == "result":
                self.on_result(w, msg)
            elif msg["op"] in ("lock", "unlock") and self.locks is not None:
                self.locks.on_message(w.pid, msg)

    def read_messages(self, w, data):
        """The whole messages in a child's bytes; a frame we cannot take kills that child.

        A child sends only well-formed frames under the size limit (it fails an
        oversize result itself); anything else means it no longer speaks the
        protocol, so its job fails and it goes, never the master.
        """
        if w.bad_frame is not None:
            return []
        try:
            messages = w.reader.feed(data)
            if not all(isinstance(m, dict) and isinstance(m.get("op"), str) for m in messages):
                raise ValueError("a message without an op")
            return messages
        except (ValueError, RecursionError) as exc:
            w.bad_frame, w.reader.buffer = exc, bytearray()
            log.error("worker %d sent a bad message (%s): killing it", w.slot, exc,
                      extra={"event": "bad_frame", "slot": w.slot, "pid": w.pid})
            try:
                self.selector.unregister(w.sock)
            except (KeyError, ValueError):
                pass
            self.kill_worker(w, "bad_frame")
            return []

    def reap_workers(self):
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            w = self.workers.pop(pid, None)
            if w is None:
                continue  # not ours (a handler's own subprocess): reaped so it leaves no zombie
            self.drain(w)
            try:
                self.selector.unregister(w.sock)
            except (KeyError, ValueError):
                pass
            w.sock.close()
            self.on_exit(w, status)

    def drain(self, w):
        """Read what a dead child wrote before it exited (a result must not be taken for a crash)."""
        w.sock.setblocking(False)
        while True:
            try:
                data = w.sock.recv(65536)
            except OSError:
                return
            if not data:
                return
            for msg in self.read_messages(w, data):
                if msg["op"] == "result":
                    self.on_result(w, msg)
                elif msg["op"] in ("lock", "unlock") and self.locks is not None:
                    self.locks.on_message(w.pid, msg)  # on_exit then releases it

    def on_exit(self, w, status):
        sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
        code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
        how = f"signal {signal.Signals(sig).name}" if sig else f"exit code {code}"
        fields = {"slot": w.slot, "pid": w.pid, "signal": sig, "exit_code": code}
        if self.locks is not None:
            self.locks.release_child(w.pid)  # now, not at their TTL: the retry may need them
        if self.stopping is None and not w.retiring:
            self.restarts += 1
            self.metrics.restarted.inc()
        if w.job is not None:
            job, w.job = w.job, None
            if w.kill_reason == "lease_lost":
                self.heartbeat.drop(job.id)
            elif w.kill_reason == "shutdown":
                self.writes.append(Write(job, "release", ()))
            elif w.kill_reason == "bad_frame":
                if isinstance(w.bad_frame, protocol.TooLarge):
                    self.fail(job, w, "result_too_large", "ResultTooLarge", f"result: {w.bad_frame}")
                else:
                    self.fail(job, w, "crashed", "BadMessage", f"child sent a bad message: {w.bad_frame}")
            elif w.kill_reason == "timeout":
                log.warning("worker %d killed: job over its hard timeout", w.slot,
                            extra=logs.job_fields(job, event="timeout_exit", **fields))
                self.fail(job, w, "timeout", "HardTimeout", f"job exceeded its timeout; child killed ({how})")
            else:
                log.error("worker %d died mid-job (%s)", w.slot, how,
                          extra=logs.job_fields(job, event="crash", **fields))
                self.counters["crashed"] += 1
                self.metrics.crashed.labels("mid_job").inc()
                self.fail(job, w, "crashed", "WorkerCrashed", f"child died mid-job ({how})")
        elif w.state == "starting" and w.kill_reason is None and self.stopping is None:
            self.boot_failures += 1
            self.metrics.crashed.labels("boot").inc()
            delay = backoff(self.boot_failures + 1, 0.1, 30.0)
            self.next_spawn_at = time.monotonic() + delay
            log.error("worker %d died at start (%s); failure %d of %d, next try in %.1fs", w.slot, how,
                      self.boot_failures, self.cfg.supervisor.max_boot_failures, delay,
                      extra=dict(fields, event="boot_failure"))
            if self.boot_failures >= self.cfg.supervisor.max_boot_failures:
                log.critical("children keep dying at start: giving up", extra={"event": "boot_failed"})
                self.exit_code = EXIT_BOOT
                self.stop_fast()
        elif w.kill_reason is None and not w.retiring and self.stopping is None:
            self.metrics.crashed.labels("idle").inc()
            log.error("worker %d died while idle (%s)", w.slot, how, extra=dict(fields, event="crash"))
        else:
            log.debug("worker %d exited (%s)", w.slot, how, extra=dict(fields, event="exit"))

    # -- jobs --------------------------------------------------------------------------
    def capacity(self):
        idle = sum(1 for w in self.workers.values()
                   if w.state == "idle" and not w.retiring and w.generation == self.generation)
        if self.prefetched and len(self.prefetched) * 2 > self.cfg.broker.prefetch:
            return 0  # refill the prefetch buffer once it is half empty: fewer, larger claims
        return idle + self.cfg.broker.prefetch - len(self.prefetched)

    def claim_jobs(self):
        if self.stopping is not None:
            return
        self.dispatch()
        now = time.monotonic()
        want = self.capacity()
        if want <= 0 or now < self.next_claim_at:
            return
        b = self.cfg.broker
        try:
            jobs = self.call(lambda br: br.claim(b.queues, want, b.lease_seconds, self.owner, self.limits), "claim")
        except BrokerError:
            return
        for job in jobs:
            self.heartbeat.hold(job.lease)
            self.on_claimed(job)
            if job.type not in self.handlers:
                self.fail(job, None, "unknown_type", "UnknownType", f"no handler for job type {job.type!r}")
            else:
                self.prefetched.append(job)
        self.dispatch()
        if jobs:
            self.empty_claims = 0
            self.next_claim_at = now
        else:
            # Back off while the queue is empty; the jitter keeps many supervisors
            # from polling a shared broker in lockstep.
            self.empty_claims += 1
            self.empty_polls += 1
            delay = backoff(self.empty_claims + 1, 0.005, self.cfg.supervisor.poll_interval, jitter=0.25)
            self.next_claim_at = now + delay

    def plan_scheduling(self):
        """The claim limits and periodic jobs of the current config and handlers."""
        self.limits = registry.type_limits(self.cfg, self.handlers) or None
        self.scheduler = scheduler.from_config(self.cfg, self.handlers)
        self.schedule_at = 0.0  # monotonic instant of the next check

    def run_schedules(self):
        if self.stopping is not None or not self.scheduler.schedules or time.monotonic() < self.schedule_at:
            return
        def check(br):
            self.scheduler.tick(br)
            return br.now()

        try:
            now = self.call(check, "schedule")
        except BrokerError:
            self.schedule_at = time.monotonic() + 1.0  # what was not enqueued stays due
            return
        self.schedule_at = time.monotonic() + max(0.0, self.scheduler.due_at() - now)

    def on_claimed(self, job):
        labels = self.metrics.job_labels(job)
        self.metrics.claimed.labels(*labels).inc()
        # The broker reclaims an expired lease inside claim and closes that
        # attempt as "lease_expired": seen here as the entry before the new one.
        expired = len(job.history) >= 2 and job.history[-2].get("outcome") == "lease_expired"
        if expired:
            self.metrics.lease_expiries.labels(*labels).inc()
        log.debug("job claimed", extra=logs.job_fields(job, event="claim",
                                                       reason="lease_expired" if expired else None))

    def dispatch(self):
        for w in self.workers.values():
            if not self.prefetched:
                return
            if w.state == "idle" and not w.retiring and w.generation == self.generation:
                self.assign(w, self.prefetched.popleft())

    def settings_for(self, job):
        """(hard timeout, soft timeout or None, max attempts) for ``job``."""
        spec = self.handlers.get(job.type)
        override = self.cfg.job_type(job.type)
        first = lambda *values: next((v for v in values if v is not None), None)  # noqa: E731
        timeout = first(job.timeout, override.timeout, spec and spec.timeout, self.cfg.jobs.timeout)
        soft = first(override.soft_timeout, spec and spec.soft_timeout, self.cfg.jobs.soft_timeout)
        attempts = first(override.max_attempts, spec and spec.max_attempts, job.max_attempts)
        return timeout, (soft or None), attempts

    def assign(self, w, job):
        timeout, soft, attempts = self.settings_for(job)
        w.job, w.state, w.started = job, "busy", time.monotonic()
        w.deadline, w.term_at = w.started + timeout, None
        message = {"op": "run", "soft_timeout": soft, "job": {
            "id": job.id, "type": job.type, "queue": job.queue, "payload": job.payload, "attempt": job.attempt,
            "max_attempts": attempts, "resource_id": job.resource_id, "idempotency_key": job.idempotency_key,
            "trace_id": job.trace_id, "token": job.token}}
        log.debug("job started on worker %d", w.slot, extra=logs.job_fields(job, event="start", slot=w.slot,
                                                                               pid=w.pid))
        try:
            protocol.send(w.sock, message)
        except OSError:
            pass  # the child just died: reaping records the crash and re-queues the job

    def on_result(self, w, msg):
        job = w.job
        if job is None or msg.get("job_id") != job.id:
            return
        w.job, w.started, w.deadline = None, None, None
        w.jobs_done += 1
        if self.locks is not None:
            self.locks.release_child(w.pid)  # a lock the job left behind ends with the job
        self.record_attempt(job, msg)
        if w.kill_reason == "lease_lost":
            self.heartbeat.drop(job.id)  # the lease is someone else's now: drop the outcome
        elif msg.get("ok"):
            self.counters["succeeded"] += 1
            self.metrics.succeeded.labels(*self.metrics.job_labels(job)).inc()
            info = self.attempt_info(w, msg)
            write = Write(job, "ack", (msg.get("result"), info))
            write.next_at = time.monotonic() + ACK_LINGER
            self.writes.append(write)
            log.info("job done in %.3fs", msg.get("duration", 0), extra=logs.job_fields(job, event="done"))
        elif w.term_at is not None:
            # It answered our SIGTERM in its grace period: still a hard timeout.
            self.fail(job, w, "timeout", "HardTimeout", "job exceeded its timeout; child stopped by SIGTERM",
                      msg.get("traceback", ""), None, msg)
        else:
            kind = msg.get("kind")
            if kind not in REASONS and kind != "retry_later":
                kind = "exception"  # the reason becomes a metric label: only known values
            self.fail(job, w, kind, msg.get("error_class", ""), msg.get("message", ""),
                      msg.get("traceback", ""), msg.get("delay"), msg)
        if w.term_at is not None or w.kill_reason is not None:
            w.state = "stopping"
            self.kill_worker(w, w.kill_reason or "timeout")  # a child we were killing: finish it off
        else:
            w.state = "idle"
            if w.retiring:
                self.retire(w)
            elif recycle := self.should_recycle(w):
                why, detail = recycle
                self.metrics.recycled.labels(why).inc()
                log.info("recycling worker %d: %s", w.slot, detail,
                         extra={"event": "recycle", "slot": w.slot, "pid": w.pid, "reason": why})
                self.retire(w)
            elif self.stopping is None:
                self.dispatch()  # the next prefetched job now: the child need not wait for the ack

    def record_attempt(self, job, msg):
        """Metrics of one finished attempt: its duration and the child's counter deltas."""
        labels = self.metrics.job_labels(job)
        if isinstance(msg.get("duration"), (int, float)):
            self.metrics.duration.labels(*labels).observe(msg["duration"])
        deltas = msg.get("metrics")
        if isinstance(deltas, dict) and isinstance(deltas.get("duplicates_suppressed"), int):
            self.counters["duplicates_suppressed"] += deltas["duplicates_suppressed"]
        self.metrics.child_deltas(job, deltas)
        if isinstance(deltas, dict) and deltas.get("lock_failed"):
            # The metric is per type; this record names the contended resource.
            log.info("lock contention: %s failed acquisitions", deltas["lock_failed"],
                     extra=logs.job_fields(job, event="lock_contention"))

    def should_recycle(self, w):
        """(reason, what to log) when ``w`` should be replaced, else None."""
        s = self.cfg.supervisor
        if s.max_jobs_per_child and w.jobs_done >= s.max_jobs_per_child:
            return "max_jobs", f"after {w.jobs_done} jobs (max_jobs_per_child)"
        if s.max_child_rss_mb:
            try:
                rss = psutil.Process(w.pid).memory_info().rss
            except psutil.Error:
                return None
            if rss > s.max_child_rss_mb * 1024 * 1024:
                return "max_rss", f"RSS {rss / 1048576:.1f} MiB over max_child_rss_mb = {s.max_child_rss_mb}"
        return None

    def attempt_info(self, w, msg=None):
        info = {"host": socket.gethostname()}
        if w is not None:
            info.update(pid=w.pid, slot=w.slot)
        if msg and "duration" in msg:
            info["duration"] = round(msg["duration"], 6)
        return info

    def fail(self, job, w, kind, exc_class, message, traceback="", delay=None, msg=None):
        """Record a failed attempt: retry with backoff, or dead-letter."""
        self.counters["failed"] += 1
        labels = self.metrics.job_labels(job)
        if kind == "timeout":
            self.counters["timeouts"] += 1
            self.metrics.timeouts.labels(*labels, "hard" if exc_class == "HardTimeout" else "soft").inc()
        _, _, attempts = self.settings_for(job)
        reason = "exception" if kind == "retry_later" else kind
        self.metrics.failed.labels(*labels, reason).inc()
        error = error_info(reason, exc_class, message, traceback)
        info = self.attempt_info(w, msg)
        fields = logs.job_fields(job, reason=reason, error=f"{exc_class}: {message}")
        if kind in ("permanent", "bad_payload", "unknown_type", "result_too_large") or job.attempt >= attempts:
            self.counters["dead"] += 1
            self.metrics.dead.labels(*labels, reason).inc()
            self.writes.append(Write(job, "dead", (reason, error, info)))
            log.warning("job dead-lettered (%s)", reason, extra=dict(fields, event="dead"))
            return
        if delay is None:
            j = self.cfg.jobs
            # A child that died under a job's first attempt was most likely killed from
            # outside (OOM killer, an operator, a deploy): run the job again at once. A
            # job that keeps killing its child backs off like any other failure.
            failures = job.attempt - 1 if kind == "crashed" else job.attempt
            delay = next_delay(failures, j.backoff_base, j.backoff_cap, j.jitter) if failures > 0 else 0.0
        self.counters["retried"] += 1
        self.metrics.retried.labels(*labels, reason).inc()
        self.writes.append(Write(job, "retry", (None, error, info, delay)))
        log.info("job failed (%s), retry in %.2fs", reason, delay, extra=dict(fields, event="retry", delay=delay))

    def murder_workers(self):
        now = time.monotonic()
        grace = self.cfg.supervisor.kill_grace
        for w in list(self.workers.values()):
            if w.job is None or w.deadline is None or now < w.deadline:
                continue
            if w.term_at is None:
                w.term_at = now
                log.warning("job over its hard timeout: SIGTERM to worker %d, SIGKILL after %.1fs", w.slot, grace,
                            extra=logs.job_fields(w.job, event="timeout_kill", slot=w.slot, pid=w.pid,
                                                  signal=int(signal.SIGTERM)))
                self.kill_worker(w, "timeout", signal.SIGTERM)
            elif now >= w.term_at + grace:
                self.kill_worker(w, "timeout", signal.SIGKILL)
        if self.stopping == "graceful" and self.stop_deadline is not None and now >= self.stop_deadline:
            log.warning("graceful timeout passed: killing the remaining children", extra={"event": "stopping"})
            self.stop_deadline = None
            for w in self.workers.values():
                self.kill_worker(w, "shutdown")

    def handle_lost_leases(self):
        while self.heartbeat.lost:
            lease = self.heartbeat.lost.popleft()
            self.counters["lease_lost"] += 1
            self.metrics.leases_lost.inc()
            for job in list(self.prefetched):
                if job.lease == lease:
                    self.prefetched.remove(job)
                    log.warning("lease lost on a prefetched job", extra=logs.job_fields(job, event="lease_lost"))
            for w in self.workers.values():
                if w.job is not None and w.job.lease == lease:
                    log.warning("lease lost: killing worker %d", w.slot,
                                extra=logs.job_fields(w.job, event="lease_lost", slot=w.slot, pid=w.pid))
                    self.kill_worker(w, "lease_lost")

    # -- broker ----------------------------------------------------------------------
    def connect_broker(self):
        if self.broker is None:
            broker = open_broker(self.cfg.broker.url)
            if self.cfg.broker.migrate:
                broker.migrate()
            fd = broker.wakeup_fd()
            if fd is not None:
                # Our own duplicate: the driver may close its socket behind our back (a
                # Redis restart), and a bare number in the selector could then come to
                # name a child's pipe. A dup stays ours until drop_broker closes it.
                self.broker_fd = os.dup(fd)
                self.selector.register(self.broker_fd, selectors.EVENT_READ, self._on_broker_wakeup)
            self.broker = broker
        return self.broker

    def _on_broker_wakeup(self, _mask):
        try:
            self.broker.drain_wakeups()
        except Exception:  # noqa: BLE001 - the listener broke: reconnect everything on the next call
            self.drop_broker()
        self.next_claim_at = time.monotonic()
        self.empty_claims = 0

    def call(self, fn, op="connect"):
        """Run ``fn(broker)``; on failure mark the broker down and reconnect later.

        Logs once when the broker goes away and once when it is back, not once
        per try. ``op`` labels the round-trip time metric.
        """
        now = time.monotonic()
        try:
            result = fn(self.connect_broker())
        except LeaseLost:
            self.metrics.broker_rtt.labels(op).observe(time.monotonic() - now)
            raise
        except ConfigError:
            self.drop_broker()
            raise  # e.g. the broker's schema is not Tangguh's: no retry can fix that
        except Exception as exc:  # noqa: BLE001 - every driver error means the same: try later
            self.metrics.broker_errors.labels("main").inc()
            self.drop_broker()
            if op in WRITE_OPS:
                # A refused outcome write retries on its own backoff. Pausing claims for
                # it could starve the very claim that reclaims its expired lease, which is
                # what finally ends that write (LeaseLost). A real outage fails the claims.
                raise BrokerError(f"{type(exc).__name__}: {exc}") from None
            if self.broker_down_since is None:
                self.broker_down_since = now
                log.error("broker unreachable, pausing claims: %s: %s", type(exc).__name__, exc,
                          extra={"event": "broker_down", "pid": self.pid})
            self.broker_retry += 1
            self.next_claim_at = now + backoff(self.broker_retry + 1, 0.2, 10.0, jitter=0.5)
            raise BrokerError(str(exc)) from None
        self.metrics.broker_rtt.labels(op).observe(time.monotonic() - now)
        if self.broker_down_since is not None:
            log.info("broker reachable again after %.1fs", now - self.broker_down_since,
                     extra={"event": "broker_up", "pid": self.pid})
            self.broker_down_since = None
        self.broker_retry = 0
        return result

    def drop_broker(self):
        if self.broker_fd is not None:
            try:
                self.selector.unregister(self.broker_fd)
            except (KeyError, ValueError):
                pass
            os.close(self.broker_fd)
            self.broker_fd = None
        if self.broker is not None:
            try:
                self.broker.close()
            except Exception:  # noqa: BLE001 - it is being thrown away anyway
                pass
            self.broker = None

    def flush_writes(self):
        now = time.monotonic()
        acks = []
        # One due ack takes every first-try ack along (they are only lingering for
        # company). An ack that failed once is retried alone below, so one ack the
        # broker refuses cannot keep failing the others until their leases expire.
        ack_due = any(w.op == "ack" and w.tries == 0 and w.next_at <= now for w in self.writes)
        for _ in range(len(self.writes)):
            write = self.writes.popleft()
            if write.op == "ack" and write.tries == 0 and ack_due:
                acks.append(write)  # stored together below
                continue
            if write.next_at > now:
                self.writes.append(write)
                continue
            # Stop renewing before the write: a renewal racing a stored outcome would find
            # the job finished and report its lease lost.
            self.heartbeat.drop(write.job.id)
            try:
                self.call(lambda br: self.apply(br, write), write.op)
            except LeaseLost:
                self.write_lost(write)
            except BrokerError as exc:
                self.write_failed(write, exc, now)
                continue
            else:
                self.stored(write)
        if acks:
            self.flush_acks(acks, now)

    def flush_acks(self, acks, now):
        """Every due ack in one ``ack_many``: one round trip (one commit on SQLite) per loop turn."""
        for write in acks:
            self.heartbeat.drop(write.job.id)  # before the write, as in flush_writes
        try:
            lost = self.call(lambda br: br.ack_many([(w.job.lease, *w.args) for w in acks]), "ack")
        except BrokerError as exc:
            for write in acks:
                self.write_failed(write, exc, now)
            return
        lost = {(lease.job_id, lease.token) for lease in lost}
        for write in acks:
            if (write.job.id, write.job.token) in lost:
                self.write_lost(write)
            else:
                self.stored(write)

    def write_failed(self, write, exc, now):
        """Retry an outcome write with backoff, and stop renewing its lease.

        A write the broker keeps refusing while lease renewals still pass would
        leave the job 'running' under a live owner forever (solid_queue #748).
        The outcome has the rest of the lease to land; after that whoever claims
        the job runs it again, and this write meets LeaseLost.
        """
        if write.tries == 0:  # once per outcome, not once per try
            log.warning("%s not stored yet, retrying: %s", write.op, exc,
                        extra=logs.job_fields(write.job, event="write_failed"))
        self.heartbeat.drop(write.job.id)
        write.tries += 1
        write.next_at = now + backoff(write.tries + 1, 0.1, 10.0, jitter=0.5)
        self.writes.append(write)

    def write_lost(self, write):
        self.counters["lease_lost"] += 1
        self.metrics.leases_lost.inc()
        log.warning("lease lost before the outcome was stored; the job will run again",
                    extra=logs.job_fields(write.job, event="lease_lost"))

    def stored(self, write):
        job = write.job
        if write.op == "ack" and job.queued_at:
            waited = max(0.0, time.time() - job.queued_at)  # the broker's clock set queued_at: close enough
            self.metrics.complete.labels(*self.metrics.job_labels(job)).observe(waited)
        event = {"ack": "acked", "retry": "retry_stored", "dead": "dead_stored", "release": "released"}[write.op]
        log.debug("outcome stored: %s", write.op, extra=logs.job_fields(job, event=event))

    def apply(self, broker, write):
        lease = write.job.lease
        if write.op == "ack":
            result, info = write.args
            broker.ack(lease, result, info)
        elif write.op == "retry":
            _, error, info, delay = write.args
            broker.retry(lease, broker.now() + delay, error, info)
        elif write.op == "dead":
            reason, error, info = write.args
            broker.dead(lease, reason, error, info)
        elif write.op == "release":
            broker.release(lease)

    def housekeeping(self):
        now = time.monotonic()
        if now >= self.next_prune_at and self.cfg.broker.retention > 0 and self.broker_down_since is None:
            self.next_prune_at = now + 300 * random.uniform(0.9, 1.1)
            try:
                self.call(lambda br: br.prune(self.cfg.broker.retention), "prune")
            except BrokerError:
                pass
        if now >= self.next_sample_at and self.broker_down_since is None:
            self.next_sample_at = now + SAMPLE_SECONDS
            try:
                self.queue_stats = self.call(lambda br: br.stats(self.cfg.broker.queues), "stats")
            except BrokerError:
                return
            self.metrics.sample_queues(self.queue_stats)

    # -- status ----------------------------------------------------------------------------
    def set_title(self):
        setproctitle.setproctitle(f"tangguh: master [{self.cfg.path or 'defaults'}] gen {self.generation}")

    def answer(self, req):
        cmd = req["cmd"]
        if cmd == "ping":
            return {"ok": True, "pong": True, "pid": self.pid}
        if cmd == "status":
            return self.status()
        if cmd == "metrics":
            return {"ok": True, "text": self.metrics.render()}
        return {"ok": False, "error": f"unknown command {cmd!r} (try ping, status, metrics)"}

    def status(self):
        return {
            "ok": True, "pid": self.pid, "started_at": self.started_at, "generation": self.generation,
            "version": __version__,
            "config": self.cfg.path, "broker": redact(self.cfg.broker.url), "reload_error": self.reload_error,
            "stopping": self.stopping, "broker_down": self.broker_down_since is not None,
            "target_workers": self.target, "prefetched": len(self.prefetched), "pending_writes": len(self.writes),
            "workers": [w.view() for w in sorted(self.workers.values(), key=lambda w: w.slot)],
            "restarts": self.restarts, "counters": dict(self.counters), "empty_polls": self.empty_polls,
            "handlers": sorted(self.handlers),
            "queues": {q: s.to_dict() for q, s in self.queue_stats.items()},
            "metrics_listen": self.exporter.address if self.exporter is not None else None,
        }


def run(config_path=None):
    """``tangguh run``: load everything, then supervise until stopped. Returns the exit code."""
    try:
        cfg = config.load(config_path)
    except ConfigError as exc:
        print(f"tangguh: error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    logs.setup(cfg.log.level, cfg.log.format)
    try:
        config.check_host(cfg)
        handlers = registry.load_handlers(cfg.supervisor.handlers, generation=1)
    except ConfigError as exc:
        print(f"tangguh: error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    arbiter = Arbiter(cfg, handlers)
    try:
        return arbiter.run()
    except ConfigError as exc:  # found only at start (supervisor.socket_group): exit 2, no restart loop
        print(f"tangguh: error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except BrokerError as exc:
        print(f"tangguh: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
