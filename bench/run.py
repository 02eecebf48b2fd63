"""Tangguh side by side with Celery, RQ, Dramatiq, Huey and Procrastinate.

    python -m bench                      # everything (a few minutes)
    python -m bench --quick              # smoke run: small counts, short bounds
    python -m bench --only throughput/tangguh-redis,latency

Needs ``pip install -e '.[bench]'``, Redis at 127.0.0.1:6379 and PostgreSQL at
127.0.0.1:5432 (see bench/README.md). Every framework runs 2 worker processes
and the same job body (``bench/work.py``), which records each execution in
Redis db 12; every figure below comes from that record. Prints a Markdown
table; writes ``bench/results/run-<time>.json`` and ``bench/results/latest.json``.
"""
import argparse
import datetime
import json
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from importlib import metadata

if __package__ in (None, ""):  # run as a script: python bench/run.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import psutil  # noqa: E402
import redis  # noqa: E402
import tomli_w  # noqa: E402

from bench import work  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
REDIS = os.environ.get("BENCH_REDIS", "redis://127.0.0.1:6379")
PG_URL = os.environ.get("BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")
EVIDENCE_URL = f"{REDIS}/12"
PEER_REDIS = f"{REDIS}/13"
PY = sys.executable
BIN = os.path.dirname(PY)

SCENARIOS = ("throughput", "enqueue", "cpu", "latency", "recovery_child", "recovery_worker", "timeout", "memory")
TANGGUH_LEASE = 5.0  # lease_seconds of the Tangguh daemons here: machine loss is noticed after this


class Settings:
    def __init__(self, quick):
        self.quick = quick
        self.noop_jobs = 1_000 if quick else 10_000
        self.throughput_budget = 10.0 if quick else 20.0  # seconds of workers running
        self.enqueue_jobs = 300 if quick else 2_000
        self.enqueue_budget = 5.0
        self.cpu_jobs = 20 if quick else 100
        self.cpu_seconds = 0.1
        self.latency_samples = 10 if quick else 40
        self.recovery_bound = 12.0 if quick else 20.0
        self.timeout_limit = 2.0
        self.rounds = 1 if quick else 3  # of the throughput and enqueue scenarios (run_rounds)


# -- frameworks ---------------------------------------------------------------------

class Framework:
    """One system under test: how to start its 2 workers and hand it jobs."""

    name = "?"
    broker = "?"
    settings = "defaults"
    batch = None  # why there is no batch enqueue, or None when there is one
    hard_timeout = None  # why there is no hard timeout, or None
    child_kill = None  # why "kill one child" makes no sense, or None

    def __init__(self, tmp):
        self.tmp = tmp
        self.procs = []
        self.env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                        BENCH_EVIDENCE_URL=EVIDENCE_URL, BENCH_PEER_REDIS=PEER_REDIS, BENCH_PG_URL=PG_URL)

    # state
    def reset(self):
        """A fresh, empty broker."""

    def cleanup(self):
        self.reset()

    # workers
    def commands(self):
        raise NotImplementedError

    def start(self):
        log = open(os.path.join(self.tmp, f"{self.name}.log"), "ab")
        for cmd in self.commands():
            self.procs.append(subprocess.Popen(cmd, cwd=self.tmp, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                               start_new_session=True))

    def stop(self, sig=signal.SIGTERM, wait=10.0):
        for p in self.procs:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(p.pid, signal.SIGKILL)  # and anything left in its group
            except ProcessLookupError:
                pass
            p.wait()
        self.procs = []

    def processes(self):
        out = []
        for p in self.procs:
            try:
                top = psutil.Process(p.pid)
                out += [top] + top.children(recursive=True)
            except psutil.Error:
                pass
        return out

    # jobs: payload is the keyword arguments of bench.work.run
    def enqueue(self, payload, timeout=None):
        raise NotImplementedError

    def enqueue_many(self, payloads):
        raise NotImplementedError


class Tangguh(Framework):
    settings = "defaults but lease_seconds=5, heartbeat_seconds=1{prefetch}{affinity}"
    prefetch = None  # --tangguh-prefetch pins broker.prefetch; None: the config default ("auto")
    cpu_affinity = None  # --tangguh-cpu-affinity sets supervisor.cpu_affinity; None: the default ("off")

    def __init__(self, tmp, broker, extra=None):
        super().__init__(tmp)
        self.broker = broker
        self.name = f"tangguh-{broker}"
        self.extra = extra or {}
        self.settings = self.settings.format(prefetch="" if self.prefetch is None else f", prefetch={self.prefetch}",
                                             affinity="" if self.cpu_affinity is None
                                             else f", cpu_affinity={self.cpu_affinity}")
        self.client = None
        self.url = None

    def reset(self):
        self.cleanup()
        tag = uuid.uuid4().hex[:10]
        if self.broker == "sqlite":
            self.url = f"sqlite:///{self.tmp}/tangguh-{tag}.db" + self.extra.get("sqlite_query", "")
        elif self.broker == "redis":
            self.url = f"{REDIS}/13?prefix=tangguh-bench-{tag}"
        else:
            self.url = f"{PG_URL}?schema=tangguh_bench_{tag}"
        from supervisor.client import Client

        self.migrate()
        self.client = Client.from_url(self.url)

    def migrate(self):
        from supervisor.backends import open_broker

        with open_broker(self.url) as b:
            b.migrate()

    def cleanup(self):
        if self.client is not None:
            self.client.close()
            self.client = None
        if self.url is None:
            return
        if self.broker == "redis":
            r = redis.Redis.from_url(f"{REDIS}/13")
            prefix = self.url.split("prefix=")[1]
            for key in r.scan_iter(match=f"{prefix}*", count=1000):
                r.delete(key)
            r.close()
        elif self.broker == "postgres":
            import psycopg

            schema = self.url.split("schema=")[1]
            with psycopg.connect(PG_URL, autocommit=True) as conn:
                conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        self.url = None

    def commands(self):
        cfg = {
            "supervisor": {"workers": 2, "handlers": os.path.join(ROOT, "bench", "handlers"),
                           "socket": os.path.join(self.tmp, f"{self.name}.sock")},
            "broker": {"url": self.url, "lease_seconds": TANGGUH_LEASE, "heartbeat_seconds": 1.0},
        }
        if self.prefetch is not None:
            cfg["broker"]["prefetch"] = self.prefetch
        if self.cpu_affinity is not None:
            cfg["supervisor"]["cpu_affinity"] = self.cpu_affinity
        for section, values in self.extra.get("config", {}).items():
            cfg.setdefault(section, {}).update(values)
        path = os.path.join(self.tmp, f"{self.name}.toml")
        with open(path, "wb") as f:
            tomli_w.dump(cfg, f)
        return [[PY, "-m", "supervisor.cli", "run", "-c", path]]

    def enqueue(self, payload, timeout=None):
        kw = {"timeout": timeout} if timeout else {}
        self.client.enqueue("bench", payload, **kw)

    def enqueue_many(self, payloads):
        self.client.enqueue_many([("bench", p) for p in payloads])


class RedisPeer(Framework):
    broker = "redis"

    def reset(self):
        r = redis.Redis.from_url(PEER_REDIS)
        r.flushdb()
        r.close()


class Celery(RedisPeer):
    name = "celery"
    settings = "defaults (prefork -c 2, prefetch multiplier 4, ack on receipt)"
    batch = "no batch enqueue API"

    def __init__(self, tmp, acks_late=False):
        super().__init__(tmp)
        if acks_late:
            self.name = "celery-acks_late"
            self.settings = "task_acks_late + task_reject_on_worker_lost, prefetch multiplier 1"
            self.env["BENCH_CELERY_MODE"] = "acks_late"
        self.env["BENCH_CELERY_MODE"] = "acks_late" if acks_late else "defaults"
        self._task = None

    @property
    def task(self):
        if self._task is None:
            os.environ["BENCH_CELERY_MODE"] = self.env["BENCH_CELERY_MODE"]
            os.environ["BENCH_PEER_REDIS"] = PEER_REDIS
            from bench.peers import celery_app

            self._task = celery_app.run
        return self._task

    def commands(self):
        return [[os.path.join(BIN, "celery"), "-A", "bench.peers.celery_app", "worker", "-c", "2", "-P", "prefork",
                 "-Q", "bench", "-l", "warning", "--without-heartbeat", "--without-gossip", "--without-mingle"]]

    def enqueue(self, payload, timeout=None):
        kw = {"time_limit": timeout} if timeout else {}
        self.task.apply_async((payload,), **kw)


class RQ(RedisPeer):
    name = "rq"
    settings = "defaults (2 `rq worker` processes, a forked work horse per job)"
    child_kill = None

    def __init__(self, tmp):
        super().__init__(tmp)
        self._queue = None

    @property
    def queue(self):
        if self._queue is None:
            import rq

            self._queue = rq.Queue("bench", connection=redis.Redis.from_url(PEER_REDIS))
        return self._queue

    def commands(self):
        return [[os.path.join(BIN, "rq"), "worker", "-u", PEER_REDIS, "-q", "-n", f"bench-{i}-{uuid.uuid4().hex[:6]}",
                 "bench"] for i in range(2)]

    def enqueue(self, payload, timeout=None):
        kw = {"job_timeout": int(timeout)} if timeout else {}
        self.queue.enqueue(work.run, kwargs=payload, **kw)

    def enqueue_many(self, payloads):
        import rq

        self.queue.enqueue_many([rq.Queue.prepare_data(work.run, kwargs=p) for p in payloads])


class Dramatiq(RedisPeer):
    name = "dramatiq"
    settings = "defaults, 2 processes x 1 thread (acks after the actor returns)"
    batch = "no batch enqueue API"

    def __init__(self, tmp):
        super().__init__(tmp)
        self._actor = None

    @property
    def actor(self):
        if self._actor is None:
            os.environ["BENCH_PEER_REDIS"] = PEER_REDIS
            from bench.peers import dramatiq_app

            self._actor = dramatiq_app.run
        return self._actor

    def commands(self):
        return [[os.path.join(BIN, "dramatiq"), "bench.peers.dramatiq_app", "-p", "2", "-t", "1", "-Q", "bench"]]

    def enqueue(self, payload, timeout=None):
        kw = {"time_limit": int(timeout * 1000)} if timeout else {}
        self.actor.send_with_options(args=(payload,), **kw)


class Huey(RedisPeer):
    name = "huey"
    settings = "defaults, process workers -k process -w 2 (no ack: a task is gone once dequeued)"
    batch = "no batch enqueue API"
    hard_timeout = "no task time limit in Huey"

    def __init__(self, tmp):
        super().__init__(tmp)
        self._task = None

    @property
    def task(self):
        if self._task is None:
            os.environ["BENCH_PEER_REDIS"] = PEER_REDIS
            from bench.peers import huey_app

            self._task = huey_app.run
        return self._task

    def commands(self):
        return [[os.path.join(BIN, "huey_consumer"), "bench.peers.huey_app.huey", "-k", "process", "-w", "2", "-q"]]

    def enqueue(self, payload, timeout=None):
        self.task(payload)


class Procrastinate(Framework):
    name = "procrastinate"
    broker = "postgres"
    settings = "defaults, 2 worker processes x concurrency 1 (LISTEN/NOTIFY)"
    hard_timeout = "no job time limit in Procrastinate"
    child_kill = "no child processes: a worker process is the whole worker (see whole-worker kill)"

    def __init__(self, tmp):
        super().__init__(tmp)
        self.schema = None
        self._app = None

    def reset(self):
        import psycopg

        self.cleanup()
        self.schema = f"bench_proc_{uuid.uuid4().hex[:10]}"
        self.env["BENCH_PG_SCHEMA"] = self.schema
        with psycopg.connect(PG_URL, autocommit=True) as conn:
            conn.execute(f'CREATE SCHEMA "{self.schema}"')
        # Apply Procrastinate's schema into ours (its search_path), in a subprocess: the app module
        # reads the schema name at import.
        subprocess.run([os.path.join(BIN, "procrastinate"), "--app=bench.peers.procrastinate_app.app", "schema",
                        "--apply"], env=self.env, cwd=self.tmp, check=True, capture_output=True)
        self._app = None

    def cleanup(self):
        if self._app is not None:
            self._app[0].close()
            self._app = None
        if self.schema is None:
            return
        import psycopg

        with psycopg.connect(PG_URL, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{self.schema}" CASCADE')
        self.schema = None

    @property
    def task(self):
        if self._app is None:
            from procrastinate import App, PsycopgConnector

            app = App(connector=PsycopgConnector(conninfo=PG_URL,
                                                 kwargs={"options": f"-c search_path={self.schema}"}))
            app.open()

            @app.task(name="bench_run", queue="bench")
            def run(kwargs):
                pass

            self._app = (app, run)
        return self._app[1]

    def commands(self):
        return [[os.path.join(BIN, "procrastinate"), "--app=bench.peers.procrastinate_app.app", "worker",
                 "--concurrency=1", "--queues=bench"] for _ in range(2)]

    def enqueue(self, payload, timeout=None):
        self.task.defer(kwargs=payload)

    def enqueue_many(self, payloads):
        self.task.batch_defer(*[{"kwargs": p} for p in payloads])


def frameworks(tmp):
    return [Tangguh(tmp, "sqlite"), Tangguh(tmp, "redis"), Tangguh(tmp, "postgres"), Celery(tmp),
            Celery(tmp, acks_late=True), RQ(tmp), Dramatiq(tmp), Huey(tmp), Procrastinate(tmp)]


# -- evidence ----------------------------------------------------------------------------

class Evidence:
    def __init__(self):
        self.r = redis.Redis.from_url(EVIDENCE_URL, decode_responses=True, socket_timeout=120)
        self.key = f"bench:{uuid.uuid4().hex[:10]}"

    def fresh(self):
        self.clear()
        self.key = f"bench:{uuid.uuid4().hex[:10]}"
        return self.key

    def clear(self):
        for k in self.r.scan_iter(match=f"{self.key}*", count=1000):
            self.r.delete(k)

    def clear_all(self):
        """Every key of every run (late writes of killed or restarted workers included)."""
        for k in self.r.scan_iter(match="bench:*", count=1000):
            self.r.delete(k)

    def count(self):
        return int(self.r.get(f"{self.key}:n") or 0)

    def records(self):
        return [tuple(float(x) for x in line.split()) for line in self.r.lrange(f"{self.key}:t", 0, -1)]

    def wait_count(self, n, bound):
        deadline = time.monotonic() + bound
        while time.monotonic() < deadline:
            if self.count() >= n:
                return True
            time.sleep(0.02)
        return False

    def next_record(self, bound):
        got = self.r.blpop([f"{self.key}:t"], timeout=bound)
        return None if got is None else tuple(float(x) for x in got[1].split())

    def next_start(self, bound):
        got = self.r.blpop([f"{self.key}:s"], timeout=bound)
        return None if got is None else tuple(float(x) for x in got[1].split())


def calibrate_spin(seconds):
    """Iterations of work.spin that take ``seconds`` in this process, on this machine, now."""
    n = 200_000
    t = time.perf_counter()
    work.spin(n)
    per = (time.perf_counter() - t) / n
    n = int(seconds / per)
    times = []
    for _ in range(3):
        t = time.perf_counter()
        work.spin(n)
        times.append(time.perf_counter() - t)
    return n, min(times)


# -- scenarios -----------------------------------------------------------------------------

class NotApplicable(Exception):
    pass


def scenario_throughput(fw, ev, s):
    """1. N no-op jobs enqueued, then the workers started; jobs/s from the first to the last execution."""
    fw.reset()
    key = ev.fresh()
    payloads = [{"kind": "noop", "key": key}] * s.noop_jobs
    if fw.batch is None:
        for i in range(0, len(payloads), 500):
            fw.enqueue_many(payloads[i:i + 500])
    else:
        for p in payloads:
            fw.enqueue(p)
    fw.start()
    try:
        ev.wait_count(s.noop_jobs, s.throughput_budget + 5.0)  # + start-up; a slow framework is cut off here
    finally:
        fw.stop()
    recs = ev.records()
    if len(recs) < 2:
        return {"jobs": len(recs), "jobs_per_s": None, "note": "fewer than 2 executions"}
    first = min(r[0] for r in recs)
    last = max(r[1] for r in recs)
    return {"jobs": len(recs), "complete": len(recs) >= s.noop_jobs, "seconds": round(last - first, 3),
            "jobs_per_s": round((len(recs) - 1) / (last - first), 1)}


def scenario_enqueue(fw, ev, s):
    """2. Enqueue rate, no workers: single calls, and batches of 500 where the API has them."""
    fw.reset()
    key = ev.fresh()
    p = {"kind": "noop", "key": key}
    fw.enqueue(p)  # connect, import
    t0, n = time.perf_counter(), 0
    while n < s.enqueue_jobs and time.perf_counter() - t0 < s.enqueue_budget:
        fw.enqueue(p)
        n += 1
    single = n / (time.perf_counter() - t0)
    out = {"single_per_s": round(single, 1), "single_jobs": n}
    if fw.batch is not None:
        out["batch_per_s"] = None
        out["batch_note"] = fw.batch
    else:
        total = s.enqueue_jobs * 5
        t0, n = time.perf_counter(), 0
        while n < total and time.perf_counter() - t0 < s.enqueue_budget:
            fw.enqueue_many([p] * 500)
            n += 500
        out["batch_per_s"] = round(n / (time.perf_counter() - t0), 1)
        out["batch_jobs"] = n
    fw.cleanup()
    return out


def measure_memory(fw):
    rss = pss = 0
    procs = fw.processes()
    for p in procs:
        try:
            m = p.memory_full_info()
        except psutil.Error:
            continue
        rss += m.rss
        pss += m.pss
    return {"processes": len(procs), "rss_mib": round(rss / 2 ** 20, 1), "pss_mib": round(pss / 2 ** 20, 1)}


def warm_up(fw, ev, bound=60.0):
    """Start the workers and wait until both have run a job (imports done, connections open)."""
    key = ev.fresh()
    fw.start()
    for _ in range(4):
        fw.enqueue({"kind": "noop", "key": key})
    if not ev.wait_count(4, bound):
        raise RuntimeError(f"{fw.name}: workers did not run 4 warm-up jobs within {bound:.0f}s")


def scenario_memory(fw, ev, s):
    """7. Idle RSS/PSS of every process of the worker (master + children), 2 s after warm-up."""
    time.sleep(2.0)
    return measure_memory(fw)


def scenario_latency(fw, ev, s):
    """4. Enqueue -> start, one job at a time with the queue idle 100-300 ms between jobs."""
    key = ev.fresh()
    lat = []
    for _ in range(s.latency_samples):
        time.sleep(random.uniform(0.1, 0.3))
        fw.enqueue({"kind": "noop", "key": key, "t0": time.time()})
        rec = ev.next_record(10.0)
        if rec is None:
            break
        lat.append((rec[0] - rec[2]) * 1000)
    if not lat:
        return {"p50_ms": None, "note": "no job ran within 10 s"}
    lat.sort()
    return {"samples": len(lat), "p50_ms": round(statistics.median(lat), 2),
            "p99_ms": round(lat[min(len(lat) - 1, int(len(lat) * 0.99))], 2), "max_ms": round(lat[-1], 2)}


def scenario_cpu(fw, ev, s):
    """3. N jobs of ~100 ms pure-Python work on 2 workers; ideal wall time / measured wall time."""
    n_iter, one = calibrate_spin(s.cpu_seconds)
    key = ev.fresh()
    before = {}
    for p in fw.processes():
        try:
            before[p.pid] = (p, sum(p.cpu_times()[:2]))
        except psutil.Error:
            pass
    payloads = [{"kind": "cpu", "key": key, "n": n_iter}] * s.cpu_jobs
    if fw.batch is None:
        fw.enqueue_many(payloads)
    else:
        for p in payloads:
            fw.enqueue(p)
    ev.wait_count(s.cpu_jobs, s.cpu_jobs * one * 3 + 10)
    recs = ev.records()
    if len(recs) < s.cpu_jobs:
        return {"efficiency": None, "note": f"only {len(recs)} of {s.cpu_jobs} jobs ran"}
    wall = max(r[1] for r in recs) - min(r[0] for r in recs)
    ideal = s.cpu_jobs * one / 2
    # CPU the framework's other processes (master, consumers, threads' hosts) burnt meanwhile
    runners = {int(r[3]) for r in recs}
    overhead = 0.0
    for pid, (p, t0) in before.items():
        if pid in runners:
            continue
        try:
            overhead += sum(p.cpu_times()[:2]) - t0
        except psutil.Error:
            pass
    return {"jobs": len(recs), "job_seconds_alone": round(one, 4), "ideal_s": round(ideal, 3),
            "wall_s": round(wall, 3), "efficiency": round(ideal / wall, 3),
            # the jobs' own durations packed on 2 workers / wall: gaps between jobs, not machine contention
            "packing": round(sum(r[1] - r[0] for r in recs) / 2 / wall, 3),
            "overhead_cpu_s": round(overhead, 3), "overhead_cpu_share": round(overhead / (2 * wall), 4),
            "mean_job_s": round(statistics.mean(r[1] - r[0] for r in recs), 4)}


def scenario_timeout(fw, ev, s):
    """6. An endless job with a 2 s limit: seconds past the limit until it stops running."""
    if fw.hard_timeout:
        raise NotApplicable(fw.hard_timeout)
    key = ev.fresh()
    fw.enqueue({"kind": "endless", "key": key}, timeout=s.timeout_limit)
    start = ev.next_start(10.0)
    if start is None:
        return {"over_s": None, "note": "the job did not start within 10 s"}
    started, pid = start
    pid = int(pid)
    bound = time.monotonic() + s.timeout_limit + 15.0
    gone = None
    while time.monotonic() < bound:
        if gone is None and not _alive(pid):
            gone = time.time()
            break
        alive = float(ev.r.get(f"{key}:alive") or started)
        if time.time() - alive > 0.3:
            break  # the job stopped, its process lives on
        time.sleep(0.005)
    else:
        return {"over_s": None, "note": f"still running {s.timeout_limit + 15:.0f} s after start"}
    if gone is not None:
        return {"over_s": round(gone - started - s.timeout_limit, 3), "process": "killed"}
    return {"over_s": round(alive - started - s.timeout_limit, 3), "process": "kept (job interrupted in-process)"}


def _alive(pid):
    """A killed process its parent has not reaped yet (a zombie) counts as gone."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def scenario_recovery_child(fw, ev, s):
    """5a. The process running a job is SIGKILLed: seconds until the job starts again."""
    if fw.child_kill:
        raise NotApplicable(fw.child_kill)
    key = ev.fresh()
    fw.enqueue({"kind": "crash", "key": key})
    start = ev.next_start(10.0)
    if start is None:
        return {"rerun_s": None, "note": "the job did not start within 10 s"}
    os.kill(int(start[1]), signal.SIGKILL)
    killed = time.time()
    again = ev.next_start(s.recovery_bound)
    if again is None:
        return {"rerun_s": None, "note": f"not re-run within {s.recovery_bound:.0f} s"}
    return {"rerun_s": round(again[0] - killed, 3)}


def scenario_recovery_worker(fw, ev, s):
    """5b. The whole worker (master and children) SIGKILLed mid-job, a new one started at once:
    seconds until it runs the job again."""
    fw.stop()  # a fresh worker: the child-kill scenario may have left this one broken (Dramatiq exits)
    warm_up(fw, ev)
    key = ev.fresh()
    fw.enqueue({"kind": "crash", "key": key})
    start = ev.next_start(10.0)
    if start is None:
        return {"rerun_s": None, "note": "the job did not start within 10 s"}
    fw.stop(signal.SIGKILL)
    killed = time.time()
    fw.start()
    again = ev.next_start(s.recovery_bound)
    if again is None:
        return {"rerun_s": None, "note": f"not re-run within {s.recovery_bound:.0f} s"}
    return {"rerun_s": round(again[0] - killed, 3)}


SESSION = (("memory", scenario_memory), ("latency", scenario_latency), ("cpu", scenario_cpu),
           ("timeout", scenario_timeout), ("recovery_child", scenario_recovery_child),
           ("recovery_worker", scenario_recovery_worker))


def attempt(fw, name, fn, *args):
    """One scenario's result; a broken scenario is its error, not the end of the run."""
    try:
        result = fn(*args)
    except NotApplicable as exc:
        result = {"na": str(exc)}
    except Exception as exc:  # noqa: BLE001 - one broken scenario must not end the run
        result = {"error": f"{type(exc).__name__}: {exc}"}
    print(f"  {fw.name} {name}: {result}", file=sys.stderr, flush=True)
    return result


# The rates that compare frameworks, each run once per round, every framework in a round before the
# next round begins (in an order turned by one each round). On a shared machine the load of one
# stretch then falls on every framework alike, and the runs a round's ratio compares lie minutes
# apart, not a quarter of an hour: the per-round ratios below are what a target is read from.
ROUNDS = (("throughput", scenario_throughput, "jobs_per_s"), ("enqueue", scenario_enqueue, "single_per_s"))


def run_rounds(fws, ev, s, only):
    """{framework: {scenario: its best run, with every round's rate}} for the ``ROUNDS`` scenarios."""
    out = {fw.name: {} for fw in fws}
    for name, fn, field in ROUNDS:
        taking = [fw for fw in fws if only(name, fw.name)]
        if not taking:
            continue
        runs = {fw.name: [] for fw in taking}
        for k in range(s.rounds):
            for fw in taking[k % len(taking):] + taking[:k % len(taking)]:
                runs[fw.name].append(attempt(fw, f"{name} (round {k + 1})", fn, fw, ev, s))
        for fw_name, results in runs.items():
            rated = [r for r in results if r.get(field)]
            # Best of the rounds: other load on a shared machine only ever slows a run down.
            best = max(rated, key=lambda r: r[field]) if rated else results[-1]
            out[fw_name][name] = dict(best, rounds=[r.get(field) for r in results])
    return out


def run_framework(fw, ev, s, wanted):
    """The scenarios not run in rounds, one framework after the other."""
    out = {}

    def record(name, fn, *args):
        out[name] = attempt(fw, name, fn, *args)

    steps = [(n, f) for n, f in SESSION if wanted(n)]
    if steps:
        fw.reset()
        try:
            warm_up(fw, ev)
            for name, fn in steps:
                record(name, fn, fw, ev, s)
        except Exception as exc:  # noqa: BLE001
            for name, _ in steps:
                out.setdefault(name, {"error": f"{type(exc).__name__}: {exc}"})
            print(f"  {fw.name}: {exc}", file=sys.stderr)
        finally:
            fw.stop()
            fw.cleanup()
    return out


# -- report ---------------------------------------------------------------------------------

def cell(result, field, fmt="{:,.0f}", unit=""):
    if result is None:
        return ""
    if "na" in result:
        return "n/a"
    if "error" in result:
        return "error"
    v = result.get(field)
    if v is None:
        note = result.get("note") or result.get("batch_note") or "-"
        return "n/a" if "batch_note" in result and field == "batch_per_s" else f"— ({note})"
    return fmt.format(v) + unit


def markdown(results):
    head = ("| framework | broker | no-op jobs/s | enqueue/s | batch enqueue/s | CPU efficiency | latency p50 / p99 ms"
            " | child kill → re-run s | worker kill → re-run s | timeout overrun s | idle PSS MiB (RSS) |")
    lines = [head, "|" + " --- |" * 2 + " ---: |" * 9]
    for name, row in results.items():
        r = row["results"]
        lat = r.get("latency")
        lat_cell = cell(lat, "p50_ms", "{:.1f}")
        if lat and lat.get("p99_ms") is not None:
            lat_cell += f" / {lat['p99_ms']:.1f}"
        mem = r.get("memory")
        mem_cell = cell(mem, "pss_mib", "{:.1f}")
        if mem and mem.get("rss_mib") is not None:
            mem_cell += f" ({mem['rss_mib']:.0f})"
        lines.append("| " + " | ".join([
            name, row["broker"], cell(r.get("throughput"), "jobs_per_s"), cell(r.get("enqueue"), "single_per_s"),
            cell(r.get("enqueue"), "batch_per_s"), cell(r.get("cpu"), "efficiency", "{:.3f}"), lat_cell,
            cell(r.get("recovery_child"), "rerun_s", "{:.2f}"), cell(r.get("recovery_worker"), "rerun_s", "{:.2f}"),
            cell(r.get("timeout"), "over_s", "{:+.2f}"), mem_cell]) + " |")
    notes = []
    for name, row in results.items():
        for scen, res in row["results"].items():
            if res and "na" in res:
                notes.append(f"- {name} / {scen}: n/a — {res['na']}")
            elif res and "error" in res:
                notes.append(f"- {name} / {scen}: error — {res['error']}")
            elif res and res.get("note"):
                notes.append(f"- {name} / {scen}: {res['note']}")
            elif res and res.get("batch_note"):
                notes.append(f"- {name} / batch enqueue: n/a — {res['batch_note']}")
    ratios = ratio_lines(results)
    return "\n".join(lines + ([""] + ratios if ratios else [])) + ("\n\n" + "\n".join(notes) if notes else "")


# What issue 17's targets compare: (scenario, its rate, Tangguh's framework, the peer, the line).
RATIOS = (("throughput", "jobs_per_s", "tangguh-redis", "huey", 2.0),
          ("throughput", "jobs_per_s", "tangguh-sqlite", "huey", 1.5),
          ("throughput", "jobs_per_s", "tangguh-postgres", "procrastinate", 20.0),
          ("throughput", "jobs_per_s", "tangguh-sqlite", "celery", 5.0),
          ("throughput", "jobs_per_s", "tangguh-redis", "celery", 5.0),
          ("throughput", "jobs_per_s", "tangguh-postgres", "celery", 5.0),
          ("enqueue", "single_per_s", "tangguh-redis", "huey", 1.0))


def paired_ratios(results):
    """Each target's ratio in every round (the two runs of one round), their median, and the
    ratio of the best runs (what the table's columns give); pairs not both run are left out."""
    out = []
    for scen, field, ours, peer, line in RATIOS:
        a = ((results.get(ours) or {}).get("results") or {}).get(scen) or {}
        b = ((results.get(peer) or {}).get("results") or {}).get(scen) or {}
        if not (a.get(field) and b.get(field)):
            continue
        per_round = [round(x / y, 2) for x, y in zip(a.get("rounds") or [], b.get("rounds") or []) if x and y]
        out.append({"scenario": scen, "ours": ours, "peer": peer, "line": line, "rounds": per_round,
                    "median": round(statistics.median(per_round), 2) if per_round else None,
                    "best": round(a[field] / b[field], 2)})
    return out


def ratio_lines(results):
    ratios = paired_ratios(results)
    if not ratios:
        return []
    lines = ["| ratio | line | each round | median of the rounds | best ÷ best |", "| --- | ---: | --- | ---: | ---: |"]
    for r in ratios:
        what = f"{r['scenario']}: {r['ours']} ÷ {r['peer']}"
        median = "" if r["median"] is None else f"{r['median']:.2f}"
        lines.append(f"| {what} | {r['line']:g} | {', '.join(f'{x:.2f}' for x in r['rounds'])} | {median}"
                     f" | {r['best']:.2f} |")
    return lines


def versions():
    out = {"python": platform.python_version()}
    for pkg in ("tangguh", "celery", "kombu", "rq", "dramatiq", "huey", "procrastinate", "redis", "psycopg"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def machine():
    model = None
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        pass
    return {"nproc": os.cpu_count(), "cpu": model, "platform": platform.platform(),
            "loadavg_at_start": os.getloadavg()}


def parse_only(spec):
    """``--only throughput/tangguh-redis,latency,/celery`` -> predicate(scenario, framework)."""
    if not spec:
        return lambda scen, fw: True
    pairs = []
    for part in spec.split(","):
        scen, _, fw = part.strip().partition("/")
        pairs.append((scen.strip() or "*", fw.strip() or "*"))
    for scen, _ in pairs:
        if scen != "*" and scen not in SCENARIOS:
            raise SystemExit(f"unknown scenario {scen!r} (expected one of {', '.join(SCENARIOS)})")

    def match(pattern, value):
        return pattern == "*" or value == pattern or (pattern.endswith("*") and value.startswith(pattern[:-1]))

    return lambda scen, fw: any(match(a, scen) and match(b, fw) for a, b in pairs)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small counts and short bounds (a smoke run)")
    parser.add_argument("--only", default="", help="SCENARIO/FRAMEWORK[,...]; either side may be empty or *; "
                        "FRAMEWORK may end in * (tangguh-*)")
    parser.add_argument("--sqlite-synchronous", choices=("full", "normal"), default="full",
                        help="Tangguh SQLite broker's ?synchronous= (default full: the broker's default)")
    parser.add_argument("--tangguh-prefetch", type=int, default=Tangguh.prefetch,
                        help="pin Tangguh's broker.prefetch (default: the config default, \"auto\")")
    parser.add_argument("--tangguh-cpu-affinity", choices=("off", "spread"), default=Tangguh.cpu_affinity,
                        help="set Tangguh's supervisor.cpu_affinity (default: the config default, \"off\")")
    parser.add_argument("--tag", default="", help="a label stored in the JSON (e.g. 'before prefetch')")
    args = parser.parse_args(argv)
    s = Settings(args.quick)
    Tangguh.prefetch = args.tangguh_prefetch
    Tangguh.cpu_affinity = args.tangguh_cpu_affinity
    only = parse_only(args.only)
    ev = Evidence()
    ev.r.ping()
    tmp = tempfile.mkdtemp(prefix="tangguh-bench-")
    began = time.time()
    results = {}
    try:
        fws = []
        for fw in frameworks(tmp):
            if isinstance(fw, Tangguh) and fw.broker == "sqlite" and args.sqlite_synchronous != "full":
                fw.extra["sqlite_query"] = f"?synchronous={args.sqlite_synchronous}"
                fw.settings += f"; ?synchronous={args.sqlite_synchronous}"
            if any(only(scen, fw.name) for scen in SCENARIOS):
                fws.append(fw)
        print(f"in rounds: {', '.join(name for name, _, _ in ROUNDS)}", file=sys.stderr, flush=True)
        rounds = run_rounds(fws, ev, s, only)
        for fw in fws:
            if rounds[fw.name]:
                fw.stop()
                fw.cleanup()
        for fw in fws:
            print(f"{fw.name} ({fw.settings})", file=sys.stderr, flush=True)
            res = dict(rounds[fw.name])
            res.update(run_framework(fw, ev, s, lambda scen, fw=fw: only(scen, fw.name)))
            results[fw.name] = {"broker": fw.broker, "settings": fw.settings, "results": res}
    finally:
        ev.clear_all()
        shutil.rmtree(tmp, ignore_errors=True)
    table = markdown(results)
    print(table)
    stamp = datetime.datetime.now(datetime.timezone.utc)
    doc = {"when": stamp.isoformat(timespec="seconds"), "tag": args.tag, "quick": args.quick, "only": args.only,
           "seconds": round(time.time() - began, 1), "machine": machine(), "versions": versions(),
           "method": {k: v for k, v in vars(s).items()}, "tangguh_lease_seconds": TANGGUH_LEASE,
           "results": results, "ratios": paired_ratios(results), "table": table}
    os.makedirs(RESULTS, exist_ok=True)
    name = f"run-{stamp.strftime('%Y%m%dT%H%M%SZ')}{'-quick' if args.quick else ''}.json"
    for path in (os.path.join(RESULTS, name), os.path.join(RESULTS, "latest.json")):
        with open(path, "w") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
    print(f"\nwrote bench/results/{name} ({doc['seconds']:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
