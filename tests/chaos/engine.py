"""The chaos soak: real supervisors, a seeded fault schedule, checked invariants.

Shared by the CI test (``tests/chaos/test_chaos.py``) and the long run
(``python -m bench.chaos``). One run:

1. start a private broker server (Redis with an append-only file, or a
   throwaway PostgreSQL cluster: both are restarted by the injector; the
   shared servers on 6379/5432 are never touched) or a SQLite file, and the
   handlers' database (``[toolkit] database_url``: a SQLite file for the
   SQLite run, a fresh schema in the shared PostgreSQL ``test`` database
   otherwise; ``ctx.lock`` uses the shared Redis under a fresh prefix);
2. start ``supervisors`` real ``tangguh run`` processes, each in its own
   process group, serving ``tests/handlers/chaos.py``;
3. enqueue ``jobs`` jobs (a seeded mix of quick, CPU-bound, slow, transiently
   failing, fail-after-commit, locked and poison jobs) over the first part of the run
   while the injector fires faults from a seeded schedule for ``duration``
   seconds;
4. wait for quiescence (polled: nothing ready, scheduled or leased; no child
   busy, nothing prefetched, no write pending), read every supervisor's
   counters, stop them with SIGTERM, then check the invariants and build the
   report.

The seed fixes the job mix and the fault schedule (kinds, instants,
durations). It cannot fix the interleaving with the processes it hits: a
replay repeats the same faults at the same moments, not the same race.

Faults (``FAULTS``): SIGKILL a busy child; SIGKILL a supervisor and start it
again; SIGTERM a supervisor (graceful) and start it again; SIGHUP, alternating a good config (workers count toggled) and a broken
one (a bad config value, or a handler file that raises on import, in turn);
a broker outage (private server SIGKILLed / stopped ``immediate`` and started
again; for SQLite, which has no server, another process holds the file's
write lock, so every broker call of every supervisor blocks, the closest a
local file comes to being unreachable); SIGSTOP a child for longer than the
lease (and sometimes longer than the hard timeout) then SIGCONT; SIGSTOP a
whole supervisor for longer than the lease, so its leases expire, another
supervisor re-runs its jobs and its late results meet the fencing tokens;
job control (``tests/chaos/control.py``): cancel a job (running, most of the
time), pause the queue and resume it; and a share of the jobs expire.

Besides the invariants, the checker proves from the broker's history that each
fault kind that fired did what it is for (a killed child's attempt recorded
crashed, a stopped child's lease kept past ``lease_seconds``, a stopped
supervisor's leases taken over and noticed, no attempt started during an
outage...), and it explains every lost lease: a survivor's ``lease_lost`` is at
least the number of its attempts the broker took over (less the jobs of a claim
the broker committed as an outage began, whose answer never reached it), and
non-zero only when a stall or an outage hit it. Counter checks take their slack from the broker's
history (attempts taken over), never from the daemon's own ``lease_lost``.
"""
import collections
import dataclasses
import heapq
import json
import math
import os
import random
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import psutil

from supervisor.backends import open_broker
from supervisor.health import request
from supervisor.model import NewJob

from ..daemon import Daemon
from . import flows
from ..util import wait_for
from .control import ControlFaults

FAULTS = ("kill_child", "kill_supervisor", "term_supervisor", "hup", "broker_outage", "stall_child",
          "stall_supervisor", "cancel", "pause")
WEIGHTS = (28, 10, 6, 18, 12, 14, 12, 10, 5)
MIX = (("chaos.quick", 52), ("chaos.cpu", 12), ("chaos.slow", 6), ("chaos.flaky", 12), ("chaos.after", 8),
       ("chaos.locked", 6), ("chaos.poison", 4))
# After the broker is back, how long a master may take to write a crash it held: the link's next
# try (its backoff after a 2 s outage is under 2 s, jitter included), then a loop turn.
CRASH_WRITE_SECONDS = 10.0
OWED_GRACE_SECONDS = 15.0  # extra tries, after the window, for a fault kind that never found a target
LOCK_TTL = 2.0  # the master renews it with the job's lease; only a stopped master lets it lapse
ACCOUNTS = 16
QUEUE = "default"
LONG_JOBS = ("chaos.slow", "chaos.cpu", "chaos.locked")
# A non-poison job may die only when injected faults used up its attempts.
FAULT_REASONS = ("crashed", "lease_expired", "timeout")
# How long before the stop signal a claim may have run and still had its answer cut: the
# claim's timestamp is taken inside the broker a moment before its reply is written.
CLAIM_CUT_MARGIN = 0.05
CLOCK_SLACK = 0.05  # seconds between this process's clock and the broker's stamps (one machine)
SHARED_POSTGRES = os.environ.get("TANGGUH_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
SHARED_REDIS = os.environ.get("TANGGUH_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


@dataclasses.dataclass
class Settings:
    broker: str = "sqlite"  # sqlite, redis, postgres
    jobs: int = 2000
    seed: int = 0
    duration: float = 20.0  # seconds of fault injection
    enqueue_seconds: float | None = None  # enqueues spread over this (default: 60 % of duration)
    fault_interval: float = 1.0  # mean seconds between faults
    supervisors: int = 2
    workers: int = 2
    lease_seconds: float = 2.0
    heartbeat_seconds: float = 0.3
    timeout: float = 5.0  # hard timeout of every chaos job
    max_attempts: int = 10  # poison jobs get 3
    quiesce_timeout: float = 120.0
    workdir: str | None = None
    keep: bool = False  # keep the work folder (logs, databases) after the run
    workflows: int | None = None  # random chains, groups, diamonds (flows.py); default: one per 40 jobs


def life_of(owner):
    """A lease owner id (host:pid:suffix) as ``Incarnation.owner`` names it (host:pid)."""
    return owner.rsplit(":", 1)[0] if isinstance(owner, str) and owner.count(":") == 2 else owner


class Incarnation:
    """One life of one supervisor process."""

    def __init__(self, pid):
        self.pid = pid
        self.pgid = pid  # Daemon starts it in a session (process group) of its own
        self.owner = f"{socket.gethostname()}:{pid}"  # its leases' owner id without the suffix drawn at start
        self.last = None  # last status seen
        self.killed = False  # ended by the soak: SIGKILL, or a graceful restart (SIGTERM)
        self.fate = "survived"  # or "killed", "terminated"
        self.final = None  # status at quiescence (survivors only)
        self.exit_code = None
        self.hits = collections.Counter()  # the faults that hit this life (what may explain its lost leases)


class Sup:
    def __init__(self, index, daemon):
        self.index, self.daemon = index, daemon
        self.state = "up"  # up, down (killed, restart due), stopped (SIGSTOP)
        self.lives = []
        self.hup_good = 0
        self.hup_broken = 0
        self.workers_seen = set()  # every child pid a status named

    @property
    def life(self):
        return self.lives[-1]

    def sessions(self):
        """The children of its lives, each the leader of a session of its own: those its live
        master has now, and those a status of any life showed (the log, at "warning", has no
        spawn records)."""
        try:
            now = {p.pid for p in psutil.Process(self.life.pid).children()}
        except psutil.Error:
            now = set()
        return now | self.workers_seen

    def start(self):
        self.daemon.start(wait=False)
        self.lives.append(Incarnation(self.daemon.proc.pid))
        self.state = "up"

    def status(self, timeout=1.0):
        try:
            st = request(self.daemon.socket, {"cmd": "status"}, timeout=timeout)
        except Exception:  # noqa: BLE001 - not answering (starting, stopped, killed) is a state here
            return None
        if st.get("pid") == self.life.pid:
            self.life.last = st
            self.workers_seen.update(w["pid"] for w in st.get("workers") or ())
            return st
        return None


class Soak(ControlFaults):
    def __init__(self, settings: Settings):
        self.s = settings
        self.rng_jobs = random.Random(f"jobs-{settings.seed}")
        self.rng_faults = random.Random(f"faults-{settings.seed}")
        self.tmp = settings.workdir or tempfile.mkdtemp(prefix=f"tangguh-chaos-{settings.broker}-")
        os.makedirs(self.tmp, exist_ok=True)
        self.server = None
        self.sups = []
        self.faults = collections.Counter()
        self.fault_log = []  # (t, kind, detail)
        self.pending = []  # heap of (at, seq, action, args): SIGCONTs, restarts, unlocks
        self.seq = 0
        self.ids = {}  # idempotency key -> job id
        self.kinds = {}  # idempotency key -> (type, amount)
        count = settings.workflows if settings.workflows is not None else settings.jobs // 40
        # Their own generator: a seed's job mix and fault schedule stay what they were without them.
        self.workflows = flows.make(random.Random(f"flows-{settings.seed}"), settings.seed, count,
                                    settings.max_attempts)
        for workflow in self.workflows:
            for key, kind, payload, *_ in workflow:
                self.kinds[key] = (kind, payload["amount"])
        self.producer_error = None
        self.flow_done = []  # first keys of the workflows stored
        self.enqueued_at = None
        self.timings = {}
        self.broker_lock = None
        self.effects_schema = None
        self.report = None
        self.hup_unconfirmed = 0
        self.hups = 0
        self.graceful_failures = []  # (supervisor, pid, exit code) of graceful restarts that did not exit 0
        self.outage = False
        # What each fault hit, for the checker to prove it did what it is for.
        self.child_kills = []  # (pid, job id, wall-clock time of the kill)
        self.child_stalls = []  # (pid, job id, seconds)
        self.sup_stalls = []  # (Incarnation, job ids its busy children ran, seconds, time.time() of the stop)
        self.lock_held_stalls = set()  # pids of masters stopped holding SQLite's write lock
        self.outages = []  # (start, end) wall-clock seconds: the broker could not be written meanwhile
        self.outage_start = None
        # (stop sent, server gone): a claim the server committed in here may have lost its
        # answer with the connection. Its supervisor never saw those jobs, so it cannot notice
        # when their leases expire and another claim takes them over.
        self.cut_windows = []
        self.stalled = {}  # pid of a stopped child -> its supervisor: no other fault may end its attempt
        # Pids of stopped children whose supervisor a fault hit all the same (no other target):
        # their attempts end with their master, so they cannot show a lease kept (check_faults).
        self.spoiled_stalls = set()
        # Supervisor -> (since when: monotonic, None while the broker is down; the pids of the
        # children killed): its master may hold a SIGKILLed child's crash unwritten, so no
        # supervisor fault may end or stop it meanwhile.
        self.crash_unstored = {}
        self.hup_good_unconfirmed = 0
        self.unquiet = ""  # what a failed quiescence found (why_unquiet)
        self.init_control()

    # -- set-up ------------------------------------------------------------------------
    def setup(self):
        b = self.s.broker
        if b == "sqlite":
            self.broker_url = f"sqlite:///{self.tmp}/broker.db"
            self.effects_db = f"sqlite:///{self.tmp}/effects.db"
        elif b == "redis":
            from ..servers import RedisServer

            os.makedirs(os.path.join(self.tmp, "redis"), exist_ok=True)
            # appendonly: a SIGKILLed redis-server keeps every write it answered
            # (written to the file before the reply; fsync matters only for host loss).
            self.server = RedisServer(os.path.join(self.tmp, "redis"), appendonly=True).start()
            self.broker_url = self.server.url + "?prefix=chaos"
        elif b == "postgres":
            from ..servers import PostgresCluster

            self.server = PostgresCluster().start()
            # The cluster runs with synchronous_commit=off for speed; an immediate
            # stop would then lose answered commits (enqueues!), which is a
            # durability setting, not the behaviour under test.
            import psycopg

            with psycopg.connect(self.server.url(), autocommit=True) as db:
                db.execute("ALTER SYSTEM SET synchronous_commit = on")
                db.execute("SELECT pg_reload_conf()")
            self.broker_url = self.server.url("postgres") + "?schema=chaos"
        else:
            raise ValueError(f"unknown broker {b!r}")
        if b != "sqlite":
            self.effects_schema = f"tangguh_chaos_{uuid.uuid4().hex[:10]}"
            self.effects_db = f"{SHARED_POSTGRES}?schema={self.effects_schema}"
        # The handlers' Redis (ctx.lock) is the shared server, under a prefix of
        # this run's own: the soak restarts only the broker's server.
        self.lock_prefix = f"tangguh-chaos-{uuid.uuid4().hex[:10]}:"
        self.locks_url = f"{SHARED_REDIS}?prefix={self.lock_prefix}"
        self.effects = Effects(self.effects_db)
        self.effects.create()
        with open_broker(self.broker_url) as br:
            br.migrate()
        for k in range(self.s.supervisors):
            d = Daemon(os.path.join(self.tmp, f"s{k}"), broker_url=self.broker_url, handler_files=("chaos.py",),
                       supervisor={"workers": self.s.workers, "poll_interval": 0.2, "graceful_timeout": 15.0,
                                   "kill_grace": 0.3},
                       # The second supervisor prefetches: its claimed-not-started jobs
                       # are released on SIGTERM, lost with it on SIGKILL.
                       broker={"lease_seconds": self.s.lease_seconds, "heartbeat_seconds": self.s.heartbeat_seconds,
                               "prefetch": 2 if k % 2 else 0},
                       jobs={"timeout": self.s.timeout, "max_attempts": self.s.max_attempts, "backoff_base": 0.05,
                             "backoff_cap": 0.5, "jitter": 0.5},
                       log={"level": "warning"}, toolkit={"database_url": self.effects_db, "redis_url": self.locks_url})
            self.sups.append(Sup(k, d))

    def teardown(self):
        self.close_control()
        for sup in self.sups:
            if sup.daemon.proc is not None:
                try:
                    os.kill(sup.daemon.proc.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
                sup.daemon.kill_group()
        if self.broker_lock is not None:
            self.broker_lock.close()
        if self.server is not None:
            if hasattr(self.server, "destroy"):
                self.server.destroy()
            else:
                self.server.stop()
        if self.effects_schema:
            self.effects.drop()
        if getattr(self, "lock_prefix", None):
            with self.redis_locks() as r:
                for key in r.scan_iter(match=f"{self.lock_prefix}*", count=1000):
                    r.delete(key)
        self.effects.close()
        if not self.s.keep:
            shutil.rmtree(self.tmp, ignore_errors=True)

    # -- the run -------------------------------------------------------------------------
    def run(self):
        """Set up, soak, check; return the report (a dict). Always tears down."""
        t0 = time.monotonic()
        try:
            self.setup()
            for sup in self.sups:
                sup.start()
            for sup in self.sups:
                wait_for(lambda sup=sup: sup.status(), timeout=60, message=f"supervisor {sup.index} to answer")
            self.t0 = time.monotonic()
            producer = threading.Thread(target=self.produce, name="chaos-producer", daemon=True)
            producer.start()
            self.inject()
            producer.join(timeout=max(60.0, self.s.quiesce_timeout))
            self.timings["inject"] = time.monotonic() - self.t0
            self.quiesce()
            self.timings["quiesce"] = time.monotonic() - self.t0 - self.timings["inject"]
            self.stop_all()
            self.report = self.check()
            self.report["seconds"] = dict(self.timings, total=round(time.monotonic() - t0, 1))
            return self.report
        finally:
            self.teardown()

    # -- producer ------------------------------------------------------------------------
    def produce(self):
        n = self.s.jobs
        spread = self.s.enqueue_seconds if self.s.enqueue_seconds is not None else 0.6 * self.s.duration
        batch = max(1, min(200, n // 100))
        jobs = []
        names, weights = zip(*MIX)
        for i in range(n):
            kind = self.rng_jobs.choices(names, weights)[0]
            key = f"chaos-{self.s.seed}-{i}"
            payload = {"amount": self.rng_jobs.randint(1, 100), "acct": self.rng_jobs.randrange(ACCOUNTS)}
            if kind == "chaos.cpu":
                payload["rounds"] = self.rng_jobs.randint(5000, 40000)
            elif kind == "chaos.slow":
                payload["secs"] = round(self.rng_jobs.uniform(0.05, 0.5), 3)
            elif kind == "chaos.flaky":
                payload["fails"] = self.rng_jobs.randint(1, 2)
            elif kind == "chaos.locked":
                payload["ttl"] = LOCK_TTL
                if self.rng_jobs.random() < 0.15:
                    payload["secs"] = round(self.rng_jobs.uniform(1.0, 2.5), 3)
            elif kind == "chaos.poison":
                payload["permanent"] = self.rng_jobs.random() < 0.5
            attempts = 3 if kind == "chaos.poison" else self.s.max_attempts
            self.kinds[key] = (kind, payload["amount"])
            jobs.append((key, kind, payload, attempts, self.expires_in(self.rng_jobs)))
        broker = None
        try:
            for start in range(0, n, batch):
                due = self.t0 + spread * start / n
                if due > time.monotonic():
                    time.sleep(due - time.monotonic())  # the schedule of arrivals
                chunk = jobs[start:start + batch]
                while True:
                    try:
                        if broker is None:
                            broker = open_broker(self.broker_url)
                        # Fresh NewJobs on every try: a retried batch dedups on the
                        # idempotency key (the job is unfinished) instead of reusing ids.
                        got = broker.enqueue_many([NewJob(kind, payload, idempotency_key=key, max_attempts=a,
                                                          expires_in=exp) for key, kind, payload, a, exp in chunk])
                        break
                    except Exception:  # noqa: BLE001 - the broker is down: the outage fault at work
                        broker = _dropped(broker)
                for (key, *_), job_id in zip(chunk, got):
                    self.ids[key] = job_id
                # The workflows arrive among the plain jobs, each in one atomic enqueue.
                while len(self.flow_done) < len(self.workflows) * (start + batch) // n:
                    workflow = self.workflows[len(self.flow_done)]
                    try:
                        if broker is None:
                            broker = open_broker(self.broker_url)
                        self.ids.update(flows.enqueue(broker, workflow))
                        self.flow_done.append(workflow[0][0])
                    except Exception:  # noqa: BLE001 - the outage fault at work: try again
                        broker = _dropped(broker)
        except BaseException as exc:  # noqa: BLE001 - reported by the checker
            self.producer_error = repr(exc)
        finally:
            self.enqueued_at = time.monotonic() - self.t0
            if broker is not None:
                broker.close()

    # -- injector ------------------------------------------------------------------------
    def schedule(self):
        """The seeded fault schedule: [(offset seconds, kind)]."""
        first = list(FAULTS) + ["hup"]  # every kind early on (in seeded order; HUP good and broken), then by weight
        self.rng_faults.shuffle(first)
        out, t = [], 0.0
        while True:
            t += self.rng_faults.expovariate(1.0 / self.s.fault_interval)
            if t >= self.s.duration:
                return out
            out.append((t, first.pop(0) if first else self.rng_faults.choices(FAULTS, WEIGHTS)[0]))

    def later(self, delay, action, *args):
        self.seq += 1
        heapq.heappush(self.pending, (time.monotonic() + delay, self.seq, action, args))

    def run_pending(self, until):
        while self.pending and self.pending[0][0] <= until:
            at, _, action, args = heapq.heappop(self.pending)
            if at > time.monotonic():
                time.sleep(at - time.monotonic())
            action(*args)

    def wait_until(self, instant):
        """Sleep until ``instant`` (the schedule), running pending actions on time meanwhile.

        A fault that ran late (a status request to a blocked master waits out
        its timeout) delays the next fault, never a SIGCONT or a restart.
        """
        while True:
            now = time.monotonic()
            self.run_pending(now)
            if now >= instant:
                return
            nxt = self.pending[0][0] if self.pending else instant
            time.sleep(max(0.0, min(instant, nxt) - now))

    def inject(self):
        owed = collections.deque()  # kinds that found no target (no busy child...): tried again next slot
        for offset, kind in self.schedule():
            self.wait_until(self.t0 + offset)
            if owed:
                owed.append(kind)
                kind = owed.popleft()
            # A full queue drops repeats, never a kind that has not landed yet this run.
            if not self.fire(kind) and (len(owed) < 10 or not self.landed(kind)):
                owed.appendleft(kind)
        # A kind not landed yet found no target in any of its slots (a supervisor was down each
        # time, no child was busy), or had too few slots (a HUP lands once good, once broken):
        # it gets more tries after the window, so that every run exercises every kind whatever
        # the seed (seen: a seed whose only HUP slot fell in a stall; the HUP owed landed good,
        # and left the queue).
        # Only kinds not yet landed: a repeat of a landed one (another supervisor stall or kill)
        # would keep the target of the missing one (all supervisors up) from ever showing.
        owed = collections.deque(dict.fromkeys(k for k in [*owed, *FAULTS] if not self.landed(k)))
        deadline = time.monotonic() + OWED_GRACE_SECONDS
        while owed and time.monotonic() < deadline:
            self.wait_until(time.monotonic() + 0.25)  # pending restarts and SIGCONTs run meanwhile
            kind = owed.popleft()
            if not self.fire(kind) or not self.landed(kind):  # a HUP landed good is owed broken still
                owed.append(kind)
        self.wait_until(self.t0 + self.s.duration)
        self.run_pending(float("inf"))  # every stopped process resumed, every server back

    def landed(self, kind):
        return all(self.faults[k] for k in (("hup_good", "hup_broken") if kind == "hup" else (kind,)))

    def fire(self, kind):
        """Inject one fault of ``kind``; False when it found no target."""
        began = time.monotonic()
        detail = getattr(self, f"fault_{kind}")()
        if detail is None:
            if time.monotonic() - began > 1.5:  # a master did not answer its status: shown, for a failure
                self.note("unanswered", f"{kind} found no target in {time.monotonic() - began:.1f}s")
            return False
        self.faults[kind if kind != "hup" else detail.split()[0]] += 1
        self.fault_log.append((round(time.monotonic() - self.t0, 2), kind, detail))
        return True

    def note(self, kind, detail):
        self.fault_log.append((round(time.monotonic() - self.t0, 2), kind, detail))

    def up(self):
        return [s for s in self.sups if s.state == "up"]

    def hittable(self, sups):
        """The supervisors a supervisor fault should hit: one without a stopped child when there
        is one (that child's attempt must end by its hard timeout or its own return, to show its
        lease kept: see check_faults), any otherwise, so no fault kind waits for a stall to end.
        Never one whose master may not have written a killed child's crash yet: a child killed
        in an outage is recorded once the broker is back, and a master killed or stopped before
        that leaves the attempt to expire (seen: a SIGKILL at the instant the outage ended)."""
        sups = [s for s in sups if not self.crash_unwritten(s)]
        return [s for s in sups if s not in self.stalled.values()] or sups

    def hit(self, sup):
        """A supervisor fault lands on ``sup``: a child of it stopped now cannot show its lease kept."""
        self.spoiled_stalls.update(pid for pid, owner in self.stalled.items() if owner is sup)

    def crash_unwritten(self, sup):
        """Whether ``sup``'s master may still hold a killed child's crash: the broker is down, or
        its status still shows the killed child (not reaped yet: its crash is not even queued; seen:
        a stop that landed at the instant of the kill), or writes waiting (for at most
        ``CRASH_WRITE_SECONDS`` after the broker is back: the link's backoff, then one turn; a busy
        master's acks linger and may always show)."""
        if sup not in self.crash_unstored:
            return False
        if self.broker_down():
            return True
        since, pids = self.crash_unstored[sup]
        if since is None:  # the broker came back by a path that did not say so: its window starts now
            since = time.monotonic()
            self.crash_unstored[sup] = (since, pids)
        if time.monotonic() - since < CRASH_WRITE_SECONDS:
            st = sup.status()
            if st is None or st["broker_down"] or st["pending_writes"] \
                    or pids & {w["pid"] for w in st["workers"]}:
                return True
        del self.crash_unstored[sup]
        return False

    def busy_child(self):
        """A (supervisor, worker) running a job right now, chosen by the seeded RNG; None if none is.

        A long job first when one runs: a quick one may end before the signal lands,
        and the fault would then prove nothing.
        """
        busy = []
        # Not one killed already: its master may not have reaped it yet (seen: a stall "landed" on
        # the pid of a child SIGKILLed 10 ms before, and its attempt ended crashed, not renewed).
        gone = self.stalled.keys() | {pid for pid, _, _ in self.child_kills}
        for sup in self.up():
            st = sup.status()
            if st:
                busy += [(sup, w) for w in st["workers"] if w["state"] == "busy" and w["pid"] not in gone]
        long = [(sup, w) for sup, w in busy if w["job_type"] in LONG_JOBS]
        return self.rng_faults.choice(long or busy) if busy else None

    def fault_kill_child(self):
        picked = self.busy_child()
        if picked is None:
            return None
        sup, w = picked
        try:
            os.kill(w["pid"], signal.SIGKILL)
        except ProcessLookupError:
            return None
        self.child_kills.append((w["pid"], w["job_id"], time.time()))
        pids = self.crash_unstored.get(sup, (None, set()))[1] | {w["pid"]}
        self.crash_unstored[sup] = (None if self.broker_down() else time.monotonic(), pids)
        return f"s{sup.index} worker {w['slot']} pid {w['pid']} ({w['job_type']})"

    def fault_kill_supervisor(self):
        live = self.up()
        if len(live) < len(self.sups) or not live:
            return None  # one supervisor down at a time keeps the queue flowing
        targets = self.hittable(live)
        if not targets:
            return None
        sup = self.rng_faults.choice(targets)
        self.hit(sup)
        sup.status()  # the last counters this incarnation shows
        os.kill(sup.life.pid, signal.SIGKILL)
        sup.life.hits["kill_supervisor"] += 1
        sup.daemon.proc.wait(10)
        sup.life.killed, sup.life.fate, sup.state = True, "killed", "down"
        self.later(self.rng_faults.uniform(0.2, 1.5), self.restart_supervisor, sup)
        return f"s{sup.index} pid {sup.life.pid}"

    def fault_term_supervisor(self):
        """A graceful restart: SIGTERM (prefetched jobs released, running ones finish), then start again."""
        live = [s for s in self.up() if s.status()]  # a master past its start (handlers installed)
        if len(live) < len(self.sups) or not live:
            return None
        targets = self.hittable(live)
        if not targets:
            return None
        sup = self.rng_faults.choice(targets)
        self.hit(sup)
        os.kill(sup.life.pid, signal.SIGTERM)
        sup.life.killed, sup.life.fate, sup.state = True, "terminated", "down"
        self.later(0.1, self.await_exit, sup, time.monotonic() + 30)
        return f"s{sup.index} pid {sup.life.pid}"

    def await_exit(self, sup, deadline):
        code = sup.daemon.proc.poll()
        if code is None and time.monotonic() < deadline:
            self.later(0.1, self.await_exit, sup, deadline)
            return
        sup.life.exit_code = code
        if code != 0:
            self.graceful_failures.append((sup.index, sup.life.pid, code))
            sup.daemon.kill_group()
        self.note("exited", f"s{sup.index} pid {sup.life.pid} exit {code}")
        self.later(self.rng_faults.uniform(0.1, 1.0), self.restart_supervisor, sup)

    def restart_supervisor(self, sup):
        sup.start()
        self.note("restart", f"s{sup.index} pid {sup.life.pid}")

    def fault_hup(self):
        live = [s for s in self.up() if s.status()]  # a master not yet past its start dies of a HUP
        if not live:
            return None
        if self.broker_lock is not None or self.sqlite_stopped():
            # The reload's wait below runs in this (the injector's) thread, so it would hold off
            # the end of the outage or the SIGCONT that frees SQLite's write lock, while the
            # reloading master's loop waits on that lock: the harness would deadlock itself.
            return None
        sup = self.rng_faults.choice(live)
        d = sup.daemon
        self.hups += 1
        if self.hups % 2 == 1:  # alternate good and broken
            sup.hup_good += 1
            cfg = json.loads(json.dumps(d.config))
            cfg["supervisor"]["workers"] = self.s.workers + sup.hup_good % 2
            d.write_config(cfg)
            generation = sup.life.last["generation"]
            os.kill(sup.life.pid, signal.SIGHUP)
            try:
                wait_for(lambda: (st := sup.status()) and st["generation"] > generation, timeout=5,
                         message="a new generation after a good reload")
                seen = "new generation seen"
            except AssertionError:
                seen = "new generation NOT seen"
                self.hup_good_unconfirmed += 1
            return f"hup_good s{sup.index} workers={cfg['supervisor']['workers']}, {seen}"
        sup.hup_broken += 1
        current = sup.life.last["target_workers"]
        broken_handler = (self.hups // 2) % 2 == 0  # a bad config value and a bad handler file, in turn
        bad = os.path.join(d.handlers, "zz_broken.py")
        if broken_handler:
            with open(bad, "w") as f:
                f.write("raise RuntimeError('a handler that does not import')\n")
        else:
            cfg = json.loads(json.dumps(d.config))
            cfg["supervisor"]["workers"] = "many"
            d.write_config(cfg)
        os.kill(sup.life.pid, signal.SIGHUP)
        try:
            wait_for(lambda: (st := sup.status()) and st.get("reload_error"), timeout=5,
                     message="reload_error after a broken reload")
            seen = "reload_error seen"
        except AssertionError:
            seen = "reload_error NOT seen"
            self.hup_unconfirmed += 1
        # Put a good config back (without a HUP) so a later restart can start.
        if broken_handler:
            os.unlink(bad)
        cfg = json.loads(json.dumps(d.config))
        cfg["supervisor"]["workers"] = current
        d.write_config(cfg)
        return f"hup_broken s{sup.index} {'handler' if broken_handler else 'config'}, {seen}"

    def fault_broker_outage(self):
        if self.stalled:
            return None  # a stopped child's lease must be kept by its master's renewals (check_faults)
        down = round(self.rng_faults.uniform(0.5, 2.0), 2)
        if self.s.broker == "sqlite":
            if self.broker_lock is not None or self.sqlite_stopped():
                return None  # a stopped master may hold the write lock: only this thread can SIGCONT it
            lock = sqlite3.connect(self.broker_url[len("sqlite:///"):], timeout=30, isolation_level=None)
            lock.execute("BEGIN EXCLUSIVE")
            self.broker_lock = lock
            self.outage_began()
            self.later(down, self.end_outage)
            return f"sqlite write lock held {down}s"
        if self.outage:
            return None
        stop_called = time.time()
        if self.s.broker == "redis":
            self.server.stop()
        else:
            self.server.stop("immediate")
        self.outage = True
        self.outage_began()
        self.cut_windows.append((stop_called, self.outage_start))
        self.later(down, self.end_outage)
        return f"{self.s.broker} server down {down}s"

    def outage_began(self):
        self.outage_start = time.time()
        for sup in self.sups:
            if sup.state != "down":
                sup.life.hits["broker_outage"] += 1

    def end_outage(self):
        self.outages.append((self.outage_start, time.time()))
        if self.s.broker == "sqlite":
            self.broker_lock.execute("ROLLBACK")
            self.broker_lock.close()
            self.broker_lock = None
        else:
            self.server.start()
            self.outage = False
        self.note("broker_back", "")
        self.crashes_writable()

    def broker_down(self):
        return self.outage or self.broker_lock is not None or self.sqlite_stopped()

    def crashes_writable(self):
        """The broker is back: the crashes it held back are written from now (``crash_unwritten``)."""
        if not self.broker_down():
            for sup, (since, pids) in self.crash_unstored.items():
                if since is None:
                    self.crash_unstored[sup] = (time.monotonic(), pids)

    def sqlite_stopped(self):
        """On SQLite, a stopped master may hold the write lock: then the broker is out for all."""
        return self.s.broker == "sqlite" and any(s.state == "stopped" for s in self.sups)

    def fault_stall_child(self):
        if self.outage or self.broker_lock is not None or self.sqlite_stopped():
            return None  # renewals fail in an outage: the stall would not show its lease kept
        picked = self.busy_child()
        if picked is None:
            return None
        sup, w = picked
        # Longer than the lease always; past the hard timeout about a third of the time.
        stall = round(self.rng_faults.uniform(self.s.lease_seconds * 1.2, self.s.timeout * 1.4), 2)
        try:
            proc = psutil.Process(w["pid"])
            proc.suspend()
        except psutil.Error:
            return None
        st = sup.status()
        if not st or not any((x["pid"], x["job_id"]) == (w["pid"], w["job_id"]) for x in st["workers"]):
            proc.resume()  # the job ended before the stop landed: a stall of an idle child proves nothing
            return None
        self.stalled[w["pid"]] = sup
        self.child_stalls.append((w["pid"], w["job_id"], stall))
        self.later(stall, self.resume, proc)
        return f"s{sup.index} worker pid {w['pid']} stopped {stall}s"

    def resume(self, proc):
        self.stalled.pop(proc.pid, None)
        try:
            proc.resume()  # psutil checks the pid still names the same process
        except psutil.Error:
            pass

    def fault_stall_supervisor(self):
        """SIGSTOP a master that holds leases (a child busy): they expire, another supervisor runs the
        jobs again, and the late outcomes of the stopped one must meet the fencing tokens."""
        live = self.up()
        if len(live) < len(self.sups) or not live:
            return None
        if self.s.broker == "sqlite" and self.stalled:
            return None  # a master stopped inside a write holds SQLite's lock: an outage for every master
        if self.paused_now:
            # On SQLite the resume waits for the stopped master (it may hold the write lock): the
            # queue would stay paused through the stall and nobody could claim its expired leases.
            return None
        holding = []
        for sup in self.hittable(live):
            st = sup.status()
            busy = [w["job_id"] for w in st["workers"] if w["state"] == "busy"] if st else []
            if busy:
                holding.append((sup, busy))
        if not holding:
            return None
        sup, busy = self.rng_faults.choice(holding)
        self.hit(sup)
        # At least a whole lease past the expiry: another supervisor takes the leases over only when
        # it claims, and a busy one (every child running, its prefetch full) may not within half a
        # lease (a loaded machine once saw no takeover in a stall of 1.5 leases).
        stall = round(self.rng_faults.uniform(self.s.lease_seconds * 2, self.s.lease_seconds * 3.5), 2)
        stopped_at = time.time()
        os.kill(sup.life.pid, signal.SIGSTOP)
        sup.state = "stopped"
        sup.life.hits["stall_supervisor"] += 1
        self.sup_stalls.append((sup.life, busy, stall, stopped_at))
        self.later(stall, self.resume_supervisor, sup)
        if self.s.broker == "sqlite":
            self.later(self.s.lease_seconds + 0.2, self.probe_sqlite_lock, sup.life)
        return f"s{sup.index} pid {sup.life.pid} stopped {stall}s"

    def probe_sqlite_lock(self, life):
        """Past its lease, can anyone write while this master is stopped? Stopped inside a write,
        it holds SQLite's lock: then no supervisor can take its leases over until it resumes."""
        conn = sqlite3.connect(self.broker_url[len("sqlite:///"):], timeout=0.5, isolation_level=None)
        try:
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("ROLLBACK")
        except sqlite3.OperationalError:
            self.lock_held_stalls.add(life.pid)
            self.note("probe", f"stopped pid {life.pid} holds the SQLite write lock: no takeover possible")
            # An outage for every other master too: none can renew its leases until it resumes.
            for sup in self.sups:
                if sup.state != "down" and sup.life is not life:
                    sup.life.hits["broker_outage"] += 1
        finally:
            conn.close()

    def resume_supervisor(self, sup):
        os.kill(sup.life.pid, signal.SIGCONT)
        sup.state = "up"
        self.crashes_writable()  # on SQLite a stopped master may have held the write lock

    # -- the end -----------------------------------------------------------------------------
    def quiet(self, broker):
        if (len(self.ids) < self.s.jobs or len(self.flow_done) < len(self.workflows)) and self.producer_error is None:
            return False
        st = broker.stats([QUEUE])[QUEUE]
        if st.ready or st.scheduled or st.in_flight:
            return False
        for sup in self.sups:
            status = sup.status()
            if status is None or status["prefetched"] or status["pending_writes"] or status["broker_down"]:
                return False
            if any(w["state"] != "idle" for w in status["workers"]):
                return False
            if status["reload_error"] is None and len(status["workers"]) != status["target_workers"]:
                return False
        return True

    def quiesce(self):
        broker = [None]
        streak = [0]

        def settled():
            try:
                if broker[0] is None:
                    broker[0] = open_broker(self.broker_url)
                ok = self.quiet(broker[0])
            except Exception:  # noqa: BLE001 - a restarted server's first refusal
                if broker[0] is not None:
                    broker[0].close()
                broker[0] = None
                ok = False
            streak[0] = streak[0] + 1 if ok else 0
            return streak[0] >= 3  # quiet three polls in a row, 0.2 s apart

        try:
            wait_for(settled, timeout=self.s.quiesce_timeout, interval=0.2, message="quiescence")
            self.quiesced = True
        except AssertionError:
            self.quiesced = False
            self.unquiet = self.why_unquiet()
        finally:
            if broker[0] is not None:
                broker[0].close()
        self.locks_at_rest = self.lock_keys()
        for sup in self.sups:
            sup.life.final = sup.status(timeout=5)
            sup.group_at_rest = group_members(sup.life.pgid, sup.sessions())

    def why_unquiet(self):
        """What a failed quiescence found, for the report: each master's process state (a stop
        never resumed shows "stopped"), its children's, whether it answers, and on SQLite whether
        anyone can take the write lock (a stopped process inside a write holds it for all)."""
        seen = []
        for sup in self.sups:
            code = sup.daemon.proc.poll() if sup.daemon.proc is not None else None
            if code is not None:  # it ended: with what, and its last words
                with open(sup.daemon.log_path, "rb") as f:
                    f.seek(max(0, os.path.getsize(sup.daemon.log_path) - 600))
                    last = f.read().decode(errors="replace").strip().splitlines()[-2:]
                seen.append(f"s{sup.index} pid {sup.life.pid} {sup.state}: exited {code}, its log ends {last}")
                continue
            try:
                proc = psutil.Process(sup.life.pid)
                states = [proc.status()] + [c.status() for c in proc.children()]
            except psutil.Error as exc:
                states = [type(exc).__name__]
            seen.append(f"s{sup.index} pid {sup.life.pid} {sup.state}: processes {states}, "
                        f"answers {sup.status() is not None}")
            # Where a master waits, when py-spy is at hand (not in CI): a stop never resumed aside.
            spy = shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))
            if spy and states[0] != "stopped":
                dump = subprocess.run([spy, "dump", "--pid", str(sup.life.pid)], capture_output=True, text=True,
                                      timeout=30)
                seen.append(f"its threads: {' | '.join(dump.stdout.split(chr(10))[:60])}")
        if self.s.broker == "sqlite":
            conn = sqlite3.connect(self.broker_url[len("sqlite:///"):], timeout=1.0, isolation_level=None)
            try:
                conn.execute("BEGIN IMMEDIATE")
                conn.execute("ROLLBACK")
                seen.append("the SQLite write lock is free")
            except sqlite3.OperationalError as exc:
                seen.append(f"the SQLite write lock is held: {exc}")
            finally:
                conn.close()
        return "; ".join(seen)

    def redis_locks(self):
        from supervisor import toolkit

        return toolkit.open_redis(self.locks_url)[0]

    def lock_keys(self):
        with self.redis_locks() as r:
            return [k.decode() for k in r.scan_iter(match=f"{self.lock_prefix}lock:*", count=1000)
                    if not k.endswith(b":fence")]

    def stop_all(self):
        for sup in self.sups:
            os.kill(sup.life.pid, signal.SIGTERM)
        for sup in self.sups:
            try:
                sup.life.exit_code = sup.daemon.proc.wait(30)
            except subprocess.TimeoutExpired:
                sup.life.exit_code = None

    # -- checks ----------------------------------------------------------------------------------
    def check(self):
        checks = []

        def check(name, ok, detail=""):
            checks.append({"name": name, "ok": bool(ok), "detail": detail})

        s = self.s
        total = s.jobs + sum(len(workflow) for workflow in self.workflows)
        check("producer enqueued every job", self.producer_error is None and len(self.ids) == total,
              f"{len(self.ids)} of {total} enqueued" + (f"; error {self.producer_error}" if self.producer_error
                                                        else ""))
        check("quiescence reached", self.quiesced,
              f"within {s.quiesce_timeout}s" if self.quiesced else f"timed out ({self.unquiet})")

        jobs = {}
        with open_broker(self.broker_url) as br:
            for key, job_id in self.ids.items():
                jobs[key] = br.get(job_id)
            stats = br.stats([QUEUE])[QUEUE]
        states = collections.Counter(j.state if j else "lost" for j in jobs.values())
        lost = [k for k, j in jobs.items() if j is None]
        # Done or dead; cancelled if this run cancelled it, expired if it had an expiry; a
        # workflow member its parent's failure cancelled is checked by flows.check.
        skipped = flows.cancelled_by_parent(self.workflows, jobs)
        stuck = [(k, j.id, j.state) for k, j in jobs.items() if j is not None
                 and j.state not in self.finished_states(k, j) and k not in skipped]
        check("every job is finished (none lost, none stuck)", not lost and not stuck,
              f"lost {len(lost)} {lost[:5]}, not finished {len(stuck)} {stuck[:5]}")
        check("no leased job left (no leaked lease)", stats.in_flight == 0 and not any(
            j and j.state == "running" for j in jobs.values()), f"in flight {stats.in_flight}")

        fx = self.effects.summary()
        effects_of = fx["effects_per_key"]
        done = [k for k, j in jobs.items() if j and j.state == "done"]
        not_once = [(k, effects_of.get(k, 0)) for k in done if effects_of.get(k, 0) != 1]
        check("every done job's effect committed exactly once", not not_once,
              f"{len(done)} done; wrong effect counts {not_once[:5]}")
        twice = [(k, n) for k, n in effects_of.items() if n > 1]
        check("no effect committed twice (any job)", not twice, f"{twice[:5]}")

        dead = [(k, j) for k, j in jobs.items() if j and j.state == "dead"]
        poison = [(k, j) for k, j in dead if self.kinds[k][0] == "chaos.poison"]
        exhausted = [(k, j) for k, j in dead if self.kinds[k][0] != "chaos.poison" and j.reason in FAULT_REASONS
                     and j.attempt >= j.max_attempts]
        unexplained = [(k, j.type, j.reason, j.attempt) for k, j in dead
                       if self.kinds[k][0] != "chaos.poison" and (k, j) not in exhausted]
        bad_poison = [(k, j.reason) for k, j in poison if j.reason not in ("exception", "permanent", *FAULT_REASONS)]
        check("every dead job is poison, or injected faults used up its attempts",
              not unexplained and not bad_poison,
              f"poison {len(poison)}, exhausted by faults {len(exhausted)}; unexplained {unexplained[:5]} "
              f"{bad_poison[:5]}")
        poison_all = [k for k, (kind, _) in self.kinds.items() if kind == "chaos.poison"]
        poison_done = [k for k in poison_all if jobs.get(k) and jobs[k].state == "done"]
        poison_fx = [k for k in poison_all if effects_of.get(k)]
        check("no poison job succeeded or committed an effect", not poison_done and not poison_fx,
              f"done {poison_done[:5]}, effects {poison_fx[:5]}")

        execs, effects, suppressed, starts = fx["executions"], fx["effects"], fx["suppressed"], fx["starts"]
        check("executions >= effects (at-least-once shows)", execs >= effects,
              f"executions {execs}, effects {effects}")
        check("duplicates suppressed = executions - effects", suppressed == execs - effects,
              f"suppressed {suppressed}, executions - effects {execs - effects}")
        check("runs started >= executions committed", starts >= execs, f"starts {starts}, executions {execs}")
        expected = sum(self.kinds[k][1] for k in effects_of)
        check("account balances = sum of committed effects", fx["balance"] == fx["effect_amount"] == expected,
              f"balances {fx['balance']}, effect rows {fx['effect_amount']}, payload amounts {expected}")
        check("one done idempotency record per effect, none left processing",
              fx["records_done"] == effects and fx["records_open"] == 0,
              f"done records {fx['records_done']}, effects {effects}, processing {fx['records_open']}")
        executed = fx["execution_runs"]
        unbacked = []
        for k in done:
            j = jobs[k]
            entry = next((h for h in reversed(j.history) if h.get("outcome") == "done"), None)
            if entry is None or (entry.get("attempt"), entry.get("pid")) not in executed.get(k, set()):
                unbacked.append((k, j.id, entry and (entry.get("attempt"), entry.get("pid"))))
        check("every ack follows a committed execution of that attempt (ack is the last step)", not unbacked,
              f"{unbacked[:5]}")

        # Locks: at rest none may be held, except one whose holder's master was
        # SIGKILLed (nobody left to release it); those must expire by their TTL.
        try:
            wait_for(lambda: not self.lock_keys(), timeout=LOCK_TTL + 2, interval=0.2, message="locks to expire")
            late = []
        except AssertionError:
            late = self.lock_keys()
        killed_any = any(life.fate == "killed" for sup in self.sups for life in sup.lives)
        check("no leaked lock (none held at rest unless its master was SIGKILLed; none after the TTL)",
              not late and (not self.locks_at_rest or killed_any),
              f"held at rest {self.locks_at_rest[:5]}, after the TTL {late[:5]}")

        # Processes.
        strays = {}
        for sup in self.sups:
            st = sup.life.final
            expected_pids = {sup.life.pid} | ({w["pid"] for w in st["workers"]} if st else set())
            extra = set(sup.group_at_rest) - expected_pids
            if extra:
                strays[f"s{sup.index}"] = sorted(extra)
        check("at rest, each supervisor's group is exactly its master and its children", not strays, f"{strays}")
        pgids = [life.pgid for sup in self.sups for life in sup.lives]
        sessions = {pid for sup in self.sups for pid in sup.sessions()}  # every child's, of every life
        try:
            wait_for(lambda: not any(group_members(g, sessions) for g in pgids), timeout=10, interval=0.2,
                     message="every process group of the soak to be empty")
            left = {}
        except AssertionError:
            left = {g: group_members(g, sessions) for g in pgids if group_members(g, sessions)}
        check("no orphan process (every group of every incarnation empty after stop)", not left, f"{left}")
        codes = {f"s{sup.index}": sup.life.exit_code for sup in self.sups}
        check("every SIGTERM (graceful restarts, final stop) ends its supervisor with exit 0",
              all(c == 0 for c in codes.values()) and not self.graceful_failures,
              f"final {codes}, graceful restarts {self.graceful_failures}")

        # Counters. They live in the master's memory: a SIGKILLed incarnation's are
        # gone (its last status read is a lower bound), a survivor's are exact,
        # except that an outcome whose write met LeaseLost is counted but not stored:
        # that attempt shows in the broker as closed "lease_expired" under its owner,
        # so the broker's history, not the daemon's own lease_lost, bounds the gap.
        by_owner = collections.defaultdict(collections.Counter)
        for j in jobs.values():
            for h in j.history if j else ():
                if "started_at" not in h:
                    continue  # cancelled or expired before it ran: not an attempt of anyone's
                owner = by_owner[life_of(h.get("owner"))]
                owner[h.get("outcome")] += 1
                if h.get("outcome") == "lease_expired" and any(
                        called - CLAIM_CUT_MARGIN <= h["started_at"] <= gone for called, gone in self.cut_windows):
                    owner["claim_cut"] += 1
                if (j.id, h.get("attempt"), h.get("pid")) in fx["suppressed_runs"]:
                    # A suppressed run the master heard of (its result carried the
                    # child's duplicates_suppressed delta), or one it may not have
                    # (the child died after its commit, or the result came late).
                    reason = (h.get("error") or {}).get("reason")
                    heard = h.get("outcome") == "done" or (h.get("outcome") in ("retry", "dead")
                                                           and reason not in ("crashed", "timeout"))
                    owner["dup_heard" if heard else "dup_maybe"] += 1
        counter_rows, counter_bad, lost_bad = [], [], []
        for sup in self.sups:
            for life in sup.lives:
                seen = by_owner.get(life.owner, collections.Counter())
                taken = seen["lease_expired"]  # this life's attempts whose lease the broker gave to another claim
                st = life.final if not life.killed else life.last
                if st is None:
                    if life.fate == "killed":
                        # SIGKILLed before it ever answered: no counters to compare, and every
                        # attempt it began was taken over (checked: no leased job left).
                        counter_rows.append((f"s{sup.index}", life.pid, "killed before its first status", dict(seen)))
                    else:
                        counter_rows.append((f"s{sup.index}", life.pid, f"{life.fate}, NO STATUS", dict(seen)))
                        counter_bad.append((f"s{sup.index}", life.pid, life.fate, "no status at quiescence"))
                    continue
                c = st["counters"]
                row = (f"s{sup.index}", life.pid, life.fate,
                       {k: c.get(k) for k in ("succeeded", "retried", "dead", "crashed", "timeouts", "lease_lost",
                                              "duplicates_suppressed")},
                       {k: seen[k] for k in ("done", "retry", "dead", "lease_expired", "claim_cut", "dup_heard",
                                             "dup_maybe")},
                       dict(life.hits))
                counter_rows.append(row)
                if not life.killed:
                    dup = c.get("duplicates_suppressed", 0)
                    if not seen["dup_heard"] <= dup <= seen["dup_heard"] + seen["dup_maybe"] + taken:
                        counter_bad.append((row[0], life.pid, "duplicates_suppressed", dup, "suppressed runs",
                                            (seen["dup_heard"], seen["dup_maybe"])))
                    pairs = (("succeeded", "done"), ("retried", "retry"), ("dead", "dead"))
                    for counter, outcome in pairs:
                        if not seen[outcome] <= c[counter] <= seen[outcome] + taken:
                            counter_bad.append((row[0], life.pid, counter, c[counter], outcome, seen[outcome]))
                    # Every lease the broker took away from a live master is noticed (heartbeat or a
                    # refused write), and a master loses leases only to a fault that stops its renewals.
                    if c["lease_lost"] < taken - seen["claim_cut"]:
                        lost_bad.append((row[0], life.pid, "lease_lost", c["lease_lost"], "taken over", taken))
                    if c["lease_lost"] and not (life.hits["stall_supervisor"] or life.hits["broker_outage"]):
                        lost_bad.append((row[0], life.pid, "lease_lost", c["lease_lost"], "faults", dict(life.hits)))
                else:
                    pend = st.get("pending_writes", 0)
                    if seen["done"] < c["succeeded"] - pend - taken:
                        counter_bad.append((row[0], life.pid, "succeeded(last seen)", c["succeeded"], "done",
                                            seen["done"]))
        check("daemon counters agree with the broker's history (survivors exact, ended lives: lower bound); "
              "every incarnation's status accounted for", not counter_bad, f"{counter_bad[:5]}")
        check("lost leases explained: each one the broker took over was noticed (but the jobs of a claim whose "
              "answer an outage cut), and only stalls and outages cause them", not lost_bad, f"{lost_bad[:5]}")
        self.check_faults(check, jobs, fx)
        self.check_control(check, jobs)
        flows.check(check, self.workflows, jobs, self.cancelled_ids)
        check("every broken reload was refused and shown in status (reload_error)", self.hup_unconfirmed == 0,
              f"{self.hup_unconfirmed} broken reloads without a reload_error")
        owners = {life.owner for sup in self.sups for life in sup.lives}
        foreign = {o for o in by_owner if o not in owners}
        check("every attempt in the broker belongs to an incarnation of this soak", not foreign, f"{foreign}")

        report = {
            "stale_leases_taken_over": self.stale_taken,
            "workflows": len(self.workflows), "workflow_jobs": sum(len(w) for w in self.workflows),
            "workflow_children_cancelled": len(skipped),
            "broker": s.broker, "jobs": s.jobs, "seed": s.seed, "supervisors": s.supervisors, "workers": s.workers,
            "lease_seconds": s.lease_seconds, "inject_seconds": s.duration, "fault_interval": s.fault_interval,
            "faults": dict(sorted(self.faults.items())), "faults_total": sum(self.faults.values()),
            "states": dict(states), "dead_poison": len(poison), "dead_exhausted_by_faults": len(exhausted),
            "fenced_writes_refused": fx["fenced"], "locks_held_at_rest": len(self.locks_at_rest),
            "starts": starts, "executions": execs, "effects": effects, "suppressed": suppressed,
            "incarnations": sum(len(sup.lives) for sup in self.sups),
            "counters": counter_rows, "checks": checks, "ok": all(c["ok"] for c in checks),
            "fault_log": self.fault_log, "control": self.control_report,
        }
        return report


    def check_faults(self, check, jobs, fx):
        """Each fault kind that fired did what it is for, shown by the broker's history."""
        by_id = {j.id: j for j in jobs.values() if j}
        # Attempts only: a job cancelled or expired before it ran has a history entry without a start.
        attempts = [(j, h) for j in by_id.values() for h in j.history if "started_at" in h]
        faults, lease = self.faults, self.s.lease_seconds

        def entry(job_id, pid):
            j = by_id.get(job_id)
            return next((h for h in (j.history if j else ()) if h.get("pid") == pid), None)

        if faults["kill_child"]:
            # Whichever job the child was running when the signal landed: the status it was picked
            # by may be a moment old, and a child given a batch goes on to the next job at once.
            # A child dies once, so an attempt of its pid recorded crashed is the kill's victim.
            crashed_pids = {h.get("pid") for _, h in attempts if (h.get("error") or {}).get("reason") == "crashed"}
            # A kill a broker outage overlapped proves nothing here: the crash waits in its master
            # while the lease runs out (2 s), and once the broker is back another claim may take the
            # job over first, its history then saying lease_expired (seen: both faults at one instant).
            # Nor does one an outage ended less than a lease before: its master could not renew
            # meanwhile, so the lease may have run out in the outage and been taken over at the
            # first claim after it, before the kill (seen: a 2.4 s outage, a kill 0.16 s after it).
            clear = [pid for pid, _, at in self.child_kills
                     if not any(start < at + 1.0 and end > at - lease for start, end in self.outages)]
            if clear:
                check("a SIGKILLed child's job was recorded crashed (and ran again)",
                      [pid for pid in clear if pid in crashed_pids],
                      f"{len(self.child_kills)} kills, {len(clear)} without a broker outage, none landed mid-job")
        stalls = [s for s in self.child_stalls if s[0] not in self.spoiled_stalls]
        if stalls:  # every stall whose supervisor no other fault hit meanwhile
            kept = [e for pid, job_id, _ in stalls if (e := entry(job_id, pid)) and "ended_at" in e
                    and e.get("outcome") != "lease_expired" and e["ended_at"] - e["started_at"] > lease]
            # What each stalled attempt became, so that a failure explains itself.
            seen = [f"{job_id} pid {pid} stopped {stall}s: "
                    + (", ".join(f"{k}={e[k]}" for k in ("started_at", "ended_at", "outcome") if k in e)
                       + (f", error={(e.get('error') or {}).get('reason')}" if e.get("error") else "")
                       if (e := entry(job_id, pid)) else "no attempt of that pid")
                    for pid, job_id, stall in stalls]
            check("a stopped child kept its lease past lease_seconds (renewed by its master)", kept,
                  f"{len(stalls)} stalls, none outlived the lease while keeping it: " + "; ".join(seen))
        elif faults["stall_child"]:  # said, not skipped in silence: the report shows it was not seen
            check("a stopped child's kept lease not shown: another fault hit each stall's supervisor", True)
        self.stale_taken = 0
        if faults["stall_supervisor"]:
            per_stall = []
            for life, job_ids, stall, stopped_at in self.sup_stalls:
                # The jobs its status showed running, and any other attempt of it that started before
                # the stop and was taken over during the stall: the status is a moment old, and a
                # short job it named may have been acked, and the next one started, before the stop.
                until = stopped_at + stall + lease + 1  # the last instant a takeover of the stall can bear
                n = sum(1 for job in by_id.values() for h in job.history
                        if life_of(h.get("owner")) == life.owner and h.get("outcome") == "lease_expired"
                        and (job.id in job_ids or (h.get("started_at", math.inf) <= stopped_at + CLOCK_SLACK
                                                   and stopped_at <= h.get("ended_at", 0) <= until)))
                per_stall.append(n)
            self.stale_taken = sum(per_stall)
            # A master stopped inside a SQLite write holds the lock (the probe saw it): an outage for
            # every supervisor, so nobody could take its leases over. Such a stall proves nothing here,
            # nor does one a broker outage overlapped: the others could not claim meanwhile, and after
            # it they reconnect with a backoff (seen: a 5.5 s stall, 1.9 s of it down, none taken over).
            open_stalls = [n for (life, _, stall, stopped_at), n in zip(self.sup_stalls, per_stall)
                           if life.pid not in self.lock_held_stalls
                           and not any(start < stopped_at + stall and end > stopped_at
                                       for start, end in self.outages)]
            # The survivors' lease_lost >= their taken-over attempts is checked with the counters:
            # the late outcome of each was refused (or dropped once the heartbeat saw the loss).
            if open_stalls:
                check("a supervisor stall outlived its lease: its leases were taken over and its late writes refused",
                      sum(open_stalls) > 0, f"stalls {len(self.sup_stalls)}, leases taken over per stall {per_stall}"
                      f", {len(self.sup_stalls) - len(open_stalls)} with SQLite's write lock held or the broker down")
            else:
                check("a supervisor stall outlived its lease: not exercised, every stopped master held SQLite's "
                      "write lock or met a broker outage (nothing could be taken over)", True, f"per stall {per_stall}")
        if faults["kill_supervisor"] or faults["term_supervisor"]:
            unrestarted = [(f"s{sup.index}", life.pid) for sup in self.sups for i, life in enumerate(sup.lives)
                           if life.killed and not any(later.last for later in sup.lives[i + 1:])]
            check("every supervisor killed or stopped came back and answered", not unrestarted, f"{unrestarted}")
        if faults["hup_good"]:
            check("every good reload started a new generation", self.hup_good_unconfirmed == 0,
                  f"{self.hup_good_unconfirmed} good reloads without a new generation")
        if faults["broker_outage"]:
            during = [(j.id, h["started_at"]) for j, h in attempts for start, end in self.outages
                      if start < h["started_at"] < end]
            check("the broker outages were real: no attempt started while the broker was down or locked",
                  self.outages and not during, f"windows {len(self.outages)}, started inside {during[:5]}")
        if fx["fenced"]:
            check("lock-fenced writes refused only when a stall or an outage stopped lock renewal",
                  faults["stall_supervisor"] or faults["broker_outage"], f"{fx['fenced']} refused")


class Effects:
    """The checker's view of the handlers' database (tables: ``tests/handlers/chaos.py``)."""

    def __init__(self, url):
        from supervisor import toolkit

        self.url = url
        self.db = toolkit.Database(url)
        self.conn = None

    def connect(self):
        if self.conn is None:
            self.conn, self.kind = self.db.connection()
            if self.kind == "postgres":
                self.conn.autocommit = True
        return self.conn

    def q(self, sql, params=()):
        conn = self.connect()
        if self.kind == "sqlite":
            sql = sql.replace("%s", "?")
        try:
            cur = conn.execute(sql, params)
        except Exception:  # noqa: BLE001 - only a connection the broker_outage fault closed is retried
            if self.kind != "postgres" or not conn.closed:
                raise
            # The private server restarted after this connection opened: once more on a new one.
            self.conn = None
            cur = self.connect().execute(sql, params)
        return cur.fetchall() if cur.description else None

    def create(self):
        from supervisor import toolkit

        from ..handlers import chaos as handler

        toolkit.migrate(self.url)  # idempotency_records (and the schema, on PostgreSQL)
        for statement in handler.TABLES:
            self.connect().execute(statement)
        for i in range(ACCOUNTS):
            self.q("INSERT INTO accounts (id, balance) VALUES (%s, 0)", (i,))

    def summary(self):
        one = lambda sql: self.q(sql)[0][0] or 0  # noqa: E731
        runs = collections.defaultdict(set)
        suppressed_runs = set()
        for key, job_id, attempt, pid, suppressed in self.q("SELECT key, job_id, attempt, pid, suppressed"
                                                            " FROM executions"):
            runs[key].add((attempt, pid))
            if suppressed:
                suppressed_runs.add((job_id, attempt, pid))
        return {
            "starts": one("SELECT count(*) FROM starts"),
            "executions": one("SELECT count(*) FROM executions"),
            "suppressed": one("SELECT count(*) FROM executions WHERE suppressed"),
            "effects": one("SELECT count(*) FROM effects"),
            "effect_amount": one("SELECT sum(amount) FROM effects"),
            "balance": one("SELECT sum(balance) FROM accounts"),
            "effects_per_key": dict(self.q("SELECT key, count(*) FROM effects GROUP BY key")),
            "execution_runs": runs,
            "suppressed_runs": suppressed_runs,
            "fenced": one("SELECT count(*) FROM fenced"),
            "records_done": one("SELECT count(*) FROM idempotency_records WHERE status = 'done'"),
            "records_open": one("SELECT count(*) FROM idempotency_records WHERE status <> 'done'"),
        }

    def drop(self):
        self.connect().execute(f'DROP SCHEMA IF EXISTS "{self.db.schema}" CASCADE')

    def close(self):
        self.db.close()
        self.conn = None


def group_members(pgid, sessions=()):
    """Live (non-zombie) processes in process group ``pgid`` (a master's) or in one of ``sessions``
    (its children's: each leads one, and what its jobs start is in it)."""
    out = []
    for p in psutil.process_iter(["pid", "status"]):
        try:
            ours = os.getpgid(p.pid) == pgid or os.getsid(p.pid) in sessions
            if ours and p.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except (ProcessLookupError, psutil.Error):
            pass
    return out


def format_report(r):
    lines = [
        f"chaos soak: broker={r['broker']} jobs={r['jobs']} seed={r['seed']} "
        f"supervisors={r['supervisors']}x{r['workers']} workers, lease {r['lease_seconds']}s",
        f"time: faults for {r['seconds'].get('inject', 0):.1f}s, quiescent after {r['seconds'].get('quiesce', 0):.1f}s"
        f" more, {r['seconds']['total']:.1f}s in all",
        f"faults injected ({r['faults_total']}): " + ", ".join(f"{k} {v}" for k, v in r["faults"].items()),
        f"supervisor incarnations: {r['incarnations']}",
        f"job control: {r.get('control')}",
        "jobs: " + ", ".join(f"{k} {v}" for k, v in sorted(r["states"].items()))
        + f" (dead: poison {r['dead_poison']}, attempts used up by faults {r['dead_exhausted_by_faults']})",
        f"runs: started {r['starts']}, executions committed {r['executions']}, effects {r['effects']}, "
        f"duplicates suppressed {r['suppressed']}, fenced writes refused {r['fenced_writes_refused']}, "
        f"leases taken over from stalled supervisors {r['stale_leases_taken_over']}, "
        f"locks held at rest {r['locks_held_at_rest']}",
        f"workflows: {r['workflows']} (chains, groups, diamonds) of {r['workflow_jobs']} jobs, "
        f"{r['workflow_children_cancelled']} children cancelled by a failed parent",
        "counters (supervisor, pid, fate, counters, broker history by owner):",
    ]
    lines += [f"  {row}" for row in r["counters"]]
    lines.append("invariants:")
    lines += [f"  {'PASS' if c['ok'] else 'FAIL'}  {c['name']}" + ("" if c["ok"] else f": {c['detail']}")
              for c in r["checks"]]
    lines.append(f"result: {'PASS' if r['ok'] else 'FAIL'} (replay: TANGGUH_CHAOS_SEED={r['seed']})")
    return "\n".join(lines)


def seed_from_env():
    value = os.environ.get("TANGGUH_CHAOS_SEED")
    return int(value) if value else random.SystemRandom().randrange(1, 2 ** 31)


def _dropped(broker):
    """Close a broker the outage broke and pause before the producer reopens one; returns None."""
    if broker is not None:
        try:
            broker.close()
        except Exception:  # noqa: BLE001 - it is broken already
            pass
    time.sleep(0.2)  # the retry pace of a producer during an outage, not a wait for a state
    return None
