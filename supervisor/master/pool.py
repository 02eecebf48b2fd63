"""The pool of children: forking, reading their pipes, reaping, deadlines, recycling.

The pool keeps the master's record of each child (``Child``) and never
touches the broker: what a child says and how it dies go to the wiring
through callbacks. Children are forked only while no other thread runs in
the master (docs/design.md, "Process-model rules"): the heartbeat is stopped
and joined around every batch of forks.
"""
import collections
import logging
import os
import selectors
import signal
import socket
import time
import traceback

from .. import childlimits, logs, protocol
from ..checks import MAX_WORKERS
from ..placement import cpu_for
from ..protocol import KILLED_BAD_FRAME, KILLED_LEASE_LOST, KILLED_SHUTDOWN, KILLED_TIMEOUT
from ..retry import backoff

log = logging.getLogger("tangguh.arbiter")

STARTING, IDLE, BUSY, STOPPING = "starting", "idle", "busy", "stopping"


class Child:
    """The master's record of one child process."""

    def __init__(self, slot, pid, sock, generation, cpu=None):
        self.slot, self.pid, self.sock, self.generation, self.cpu = slot, pid, sock, generation, cpu  # cpu: its pin
        self.reader = protocol.Reader()
        self.state = STARTING
        self.job = None  # the job it runs: the first of its batch not answered yet
        self.settings = None  # registry.JobSettings the job was claimed under
        self.queued = collections.deque()  # (job, settings) of its batch behind ``job``, in order
        self.lost, self.cancels = set(), {}  # its jobs' ids: lease lost (outcome dropped); cancelled -> request
        self.skip_sent = self.ran_long = False  # asked to skip its batch's rest; its last job was long
        self.started = self.deadline = None  # monotonic: the current job's start, its hard-timeout instant
        self.term_at, self.kill_reason = None, None  # when SIGTERM was sent (hard timeout grace); why killing it
        self.cancel_at = self.cancel_deadline = None  # monotonic: its job's cancel was sent; the kill after grace
        self.progress = None  # (fraction, note) its job last reported
        self.jobs_done, self.retiring = 0, False
        self.done_at_send = 0  # jobs_done when its last RUN message went out (top-ups: dispatch.top_up)
        self.sent_bytes = 0  # the size of that message (the prefetch learns the jobs' sizes)
        self.bad_frame = None  # the error of a message the protocol cannot take: no more reading
        # What a message to it may hold while it is busy: a quarter of its pipe (one top-up unread at a time).
        self.room = min(protocol.TOP_UP_BYTES, sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) // 4)


class Pool:
    """``target`` children of the current ``generation``, kept whole.

    Callbacks (all run in the main loop):
    ``run_child(sock, slot, cpu)`` runs in a fresh child and never returns;
    ``on_reply(child, msg)`` a child's RESULT; ``on_lock(child, msg)`` its
    LOCK/UNLOCK; ``on_exit(child, how, fields)`` a reaped child;
    ``on_boot_failed()`` children keep dying at start; ``count(event, *labels)``.
    """

    def __init__(self, cfg, selector, heartbeat, run_child, on_reply, on_lock, on_exit, on_boot_failed, count):
        self.cfg = cfg  # config.SupervisorConfig; replaced on reload
        self.selector, self.heartbeat = selector, heartbeat
        self.run_child, self.on_reply, self.on_lock = run_child, on_reply, on_lock
        self.on_exit, self.on_boot_failed, self.count = on_exit, on_boot_failed, count
        self.children = {}  # pid -> Child
        self.others = {}  # pid -> exited(status), for another process the master forked (a reload's trial)
        self.target, self.generation = cfg.workers, 1
        self.stopping, self.restarts, self.boot_failures, self.spawn_failures = False, 0, 0, 0
        self.next_spawn_at = 0.0
        self.threads_seen = frozenset()  # other threads of the master at the last fork (warned of once)

    # -- size ---------------------------------------------------------------------------
    def resize(self, by):
        """SIGTTIN (+1) / SIGTTOU (-1): the new target, within 1 .. ``MAX_WORKERS`` (a reload sets the config's)."""
        self.target = min(MAX_WORKERS, max(1, self.target + by))
        return self.target

    def live(self):
        return [c for c in self.children.values() if c.generation == self.generation and not c.retiring]

    def missing(self):
        return self.target - len(self.live())

    def free(self):
        """Idle children of the current generation, ready for a job."""
        return [c for c in self.live() if c.state == IDLE]

    def all_started(self):
        """Every child up; while the system refuses forks, every child it let us fork (one at least)."""
        forked = self.missing() <= 0 or (self.spawn_failures > 0 and bool(self.live()))
        return forked and all(c.state != STARTING for c in self.children.values())

    def spawn_due_at(self):
        return self.next_spawn_at if not self.stopping and self.missing() > 0 else None

    def manage(self):
        """Spawn or retire children to reach ``target``."""
        if self.stopping:
            return
        missing = self.missing()
        if missing <= 0:
            self.spawn_failures = 0  # whole again (forks came back, or a lower target): no shortfall to report
        if missing > 0 and time.monotonic() >= self.next_spawn_at:
            self.spawn(missing)
        elif missing < 0:  # one from the CPU the most hold ("spread"; else None for all), the least busy, newest
            order = {STARTING: 0, IDLE: 1, BUSY: 2}
            for _ in range(-missing):
                held = collections.Counter(c.cpu for c in self.live())
                self.retire(min(self.live(), key=lambda c: (-held[c.cpu], order.get(c.state, 3), -c.slot)))

    def spawn(self, n):
        # Fork only while no other thread runs (docs/design.md, process-model rules).
        running = self.heartbeat.thread is not None
        self.heartbeat.stop()
        self.threads_seen = childlimits.warn_of_threads(self.threads_seen)
        try:
            for _ in range(n):
                self.spawn_one()
            self.spawn_failures = 0
        except OSError as exc:
            # Out of descriptors or processes (ulimit, TasksMax): serve on with the children there are.
            self.spawn_failures += 1
            self.count("spawn_failed")
            delay = backoff(self.spawn_failures + 1, 0.1, 30.0)
            self.next_spawn_at = time.monotonic() + delay
            log.error("cannot start a worker (%d of %d running): %s; next try in %.1fs", len(self.live()),
                      self.target, exc, delay, extra={"event": "spawn_failed"})
        finally:
            if running:
                self.heartbeat.start()

    def spawn_one(self):
        childlimits.check_descriptors()
        used = {c.slot for c in self.children.values()}
        slot = next(i for i in range(len(used) + 1) if i not in used)
        cpu = cpu_for(self.cfg.cpu_affinity, self.children.values())  # None unless "spread"
        parent_sock, child_sock = socket.socketpair()
        try:
            pid = os.fork()
        except OSError:
            parent_sock.close()
            child_sock.close()
            raise
        if pid == 0:
            # From here on this is the child: whatever happens, it must never
            # return into the master's loop.
            try:
                childlimits.own_session()  # first: a kill of its session's group must reach what its jobs start
                parent_sock.close()
                for c in self.children.values():
                    c.sock.close()
                self.run_child(child_sock, slot, cpu)  # never returns
            except BaseException:  # noqa: BLE001 - shown in the log; the master counts a boot failure
                traceback.print_exc()
            finally:
                os._exit(1)
        child_sock.close()
        parent_sock.settimeout(5.0)
        self.children[pid] = c = Child(slot, pid, parent_sock, self.generation, cpu)
        self.selector.register(parent_sock, selectors.EVENT_READ, lambda mask, c=c: self.read(c))
        self.count("spawned")
        log.info("spawned worker %d", slot, extra={"event": "spawn", "slot": slot, "pid": pid,
                                                   "generation": self.generation})

    # -- talking to children -------------------------------------------------------------
    def run(self, c, batch, start_by=None):
        """Hand ``batch`` (a list of (job, settings)) to child ``c``: one message, run in order.
        An idle child starts its first job now; a busy one queues them all behind its own.
        ``start_by``: job id -> the instant past which the child skips it (protocol.run_message).

        A busy child reads nothing until its job ends, so a message to it must fit in its
        pipe (``room``): a longer one would block the master's send until the child read.
        Its first jobs that fit go; the rest are returned, to wait for a free child.
        """
        left, frame = [], protocol.run_frame(batch, start_by)
        while c.job is not None and len(frame) > c.room and batch:
            batch, left = batch[:len(batch) // 2], batch[len(batch) // 2:] + left
            frame = protocol.run_frame(batch, start_by)
        if not batch:
            return left
        if c.job is None:
            self.start(c, *batch[0])
            c.queued.extend(batch[1:])
        else:
            c.queued.extend(batch)
        c.skip_sent, c.done_at_send = False, c.jobs_done
        if len(batch) > 1 or c.job is not batch[0][0]:  # " (busy)": queued behind the job it runs
            log.debug("batch of %d jobs to worker %d%s", len(batch), c.slot, " (busy)" * (c.job is not batch[0][0]),
                      extra={"event": "batch", "slot": c.slot, "pid": c.pid})
        c.sent_bytes = len(frame)
        try:
            protocol.write_frame(c.sock, frame)
        except OSError:
            pass  # the child just died: reaping records the crash and re-queues the jobs
        return left

    def start(self, c, job, settings):
        """Record that ``c`` runs ``job`` from now: its hard-timeout deadline starts here."""
        c.job, c.settings, c.state, c.started = job, settings, BUSY, time.monotonic()
        c.deadline, c.term_at = c.started + settings.timeout, None
        c.cancel_at = c.cancel_deadline = c.progress = None
        if log.isEnabledFor(logging.DEBUG):
            log.debug("job started on worker %d", c.slot,
                      extra=logs.job_fields(job, event="start", slot=c.slot, pid=c.pid))

    def finish(self, c, ran=True):
        """The job ``c`` ran (or skipped: ``ran`` False) has ended: forget it; returns (job, settings).

        The next job of its batch is running from now on, unless the child is
        being killed (it is handed back when the child is gone).
        """
        job, settings = c.job, c.settings
        c.job = c.settings = c.started = c.deadline = c.cancel_deadline = c.progress = None
        c.jobs_done += ran  # what max_jobs_per_child and the top-ups count: jobs run, not skipped
        if c.queued and c.kill_reason is None and c.term_at is None:
            self.start(c, *c.queued.popleft())
        return job, settings

    def after_reply(self, c):
        """Decide what becomes of ``c`` once its reply is judged; True when it is free for the next job."""
        if c.term_at is not None or c.kill_reason is not None:
            c.state = STOPPING
            self.kill(c, c.kill_reason or KILLED_TIMEOUT)  # a child we were killing: finish it off
            return False
        c.state = IDLE
        if c.retiring:
            self.retire(c)
            return False
        recycle = childlimits.recycle_reason(self.cfg, c)
        if recycle:
            why, detail = recycle
            self.count("recycled", why)
            log.info("recycling worker %d: %s", c.slot, detail,
                     extra={"event": "recycle", "slot": c.slot, "pid": c.pid, "reason": why})
            self.retire(c)
            return False
        return True

    def retire(self, c):
        """Ask a child to exit after its current job (at once when idle)."""
        c.retiring = True
        if c.state != BUSY:
            c.state = STOPPING
            try:
                protocol.send(c.sock, {"op": protocol.STOP})
            except OSError:
                pass  # already gone: reaping will account for it

    def retire_all(self, older_than=None):
        """Retire every child, or those of a generation before ``older_than``."""
        for c in self.children.values():
            if older_than is None or c.generation < older_than:
                self.retire(c)

    def kill(self, c, reason, sig=signal.SIGKILL):
        if c.kill_reason is None or reason == KILLED_LEASE_LOST:
            c.kill_reason = reason  # a lost lease wins: its outcome must be dropped, whatever else happened
        childlimits.signal_child(c.pid, sig)  # and the processes its jobs started

    def cancel(self, c, request, waited=0.0):
        """Tell ``c`` its job is cancelled (CANCEL frame + signal); ``cancel_grace`` counts from the request."""
        c.cancel_at = time.monotonic()
        c.cancel_deadline = c.cancel_at + max(0.0, self.cfg.cancel_grace - waited)
        request = request if isinstance(request, dict) else {}
        try:
            protocol.send(c.sock, {"op": protocol.CANCEL, "job_id": c.job.id, **request})
            os.kill(c.pid, protocol.CANCEL_SIGNAL)
        except OSError:
            pass  # it just died: reaping judges the job (cancelled: the cancel was sent)

    def kill_all(self, reason=KILLED_SHUTDOWN):
        for c in self.children.values():
            self.kill(c, reason)

    def read(self, c):
        try:
            # Not recv: the socket's timeout makes every recv poll first, and the selector just did.
            data = os.read(c.sock.fileno(), 65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self.unregister(c)  # EOF: the child is gone; reaping does the rest
            return
        self.messages(c, data)

    def unregister(self, c):
        try:
            self.selector.unregister(c.sock)
        except (KeyError, ValueError):
            pass  # already

    def messages(self, c, data):
        """Act on a child's messages. A child sends only well-formed frames under the size limit
        (it fails an oversize result itself); anything else means it no longer speaks the
        protocol, so it goes, never the master. The messages before such a frame are acted on
        first: the jobs they answer ended as they say, and only the job running when the frame
        came is judged by it (verdict)."""
        if c.bad_frame is not None:
            return
        messages, bad = c.reader.feed(data)
        for msg in messages:
            op = msg["op"]
            if op == protocol.READY:
                c.state = IDLE if c.state == STARTING else c.state
                self.boot_failures = 0
            elif op == protocol.RESULT:
                self.on_reply(c, protocol.clean_result(msg))
            elif op in (protocol.LOCK, protocol.UNLOCK):
                self.on_lock(c, msg)
            elif op == protocol.PROGRESS:
                self.progress(c, msg)
        if bad is not None:
            c.bad_frame = bad
            log.error("worker %d sent a bad message (%s): killing it", c.slot, bad,
                      extra={"event": "bad_frame", "slot": c.slot, "pid": c.pid})
            self.unregister(c)
            self.kill(c, KILLED_BAD_FRAME)

    def progress(self, c, msg):
        """Keep a running job's progress (for status) and hand it to the heartbeat's next renewal."""
        fraction, note = msg.get("fraction"), msg.get("note")
        if c.job is None or msg.get("job_id") != c.job.id or type(fraction) not in (int, float) \
                or not 0 <= fraction <= 1:
            return  # late (its job is over) or malformed: a progress report is never worth a kill
        note = note[:protocol.MAX_NOTE] if isinstance(note, str) else ""
        c.progress = (fraction, note)
        self.heartbeat.report_progress(c.job.id, fraction, note)

    # -- reaping -----------------------------------------------------------------------
    def reap(self):
        while True:
            try:
                pid, status = childlimits.reap_any(self.children)  # what a child left running dies with it
            except ChildProcessError:
                return
            if pid == 0:
                return
            c = self.children.pop(pid, None)
            if c is None:
                exit_of = self.others.pop(pid, None)  # a reload's trial import: its verdict
                if exit_of is not None:
                    exit_of(status)
                continue  # not ours (a handler's own subprocess): reaped so it leaves no zombie
            self.drain(c)
            self.unregister(c)
            c.sock.close()
            self.exited(c, status)
            if self.spawn_failures and c.state != STARTING:
                self.next_spawn_at = 0.0  # forks were refused: what it held is free, try now

    def drain(self, c):
        """Read what a dead child wrote before it exited (a result must not be taken for a crash)."""
        c.sock.setblocking(False)
        while True:
            try:
                data = c.sock.recv(65536)
            except OSError:
                return
            if not data:
                return
            self.messages(c, data)

    def exited(self, c, status):
        sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
        code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
        how = childlimits.how_it_ended(status)
        fields = {"slot": c.slot, "pid": c.pid, "signal": sig, "exit_code": code}
        if not self.stopping and not c.retiring:
            self.restarts += 1
            self.count("restarted")
        had_job = c.job is not None or bool(c.queued)
        self.on_exit(c, how, fields)  # a job it was running is judged there
        if had_job:
            return
        if c.state == STARTING and c.kill_reason is None and not self.stopping:
            self.boot_failures += 1
            self.count("crashed_boot")
            delay = backoff(self.boot_failures + 1, 0.1, 30.0)
            self.next_spawn_at = time.monotonic() + delay
            log.error("worker %d died at start (%s); failure %d of %d, next try in %.1fs", c.slot, how,
                      self.boot_failures, self.cfg.max_boot_failures, delay,
                      extra=dict(fields, event="boot_failure"))
            if self.boot_failures >= self.cfg.max_boot_failures:
                log.critical("children keep dying at start: giving up", extra={"event": "boot_failed"})
                self.on_boot_failed()
        elif c.kill_reason is None and not c.retiring and not self.stopping:
            self.count("crashed_idle")
            log.error("worker %d died while idle (%s)", c.slot, how, extra=dict(fields, event="crash"))
        else:
            log.debug("worker %d exited (%s)", c.slot, how, extra=dict(fields, event="exit"))
