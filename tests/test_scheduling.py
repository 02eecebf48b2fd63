"""Scheduling controls above the broker: periodic jobs, the config and decorator keys, the CLI.

The broker side of each control (limits at claim time, ``enqueue_once``) is in
the conformance suite; here: the scheduler's exactly-once ticks with two
schedulers racing on every backend, catch-up, and real supervisors.
"""
import datetime
import json
import multiprocessing
import os
import re
import signal
import tomllib

import pytest
import tomli_w

import supervisor
from supervisor import config, registry
from supervisor.backends import open_broker
from supervisor.errors import ConfigError
from supervisor.model import NewJob, TypeLimits
from supervisor.scheduler import Schedule, Scheduler, tick_key

from .daemon import Daemon, tangguh
from .util import wait_for

T0 = 1_800_000_000.0  # a whole second: "* * * * * *" ticks on it


def new_job(sched, key):
    return NewJob(sched.type, dict(sched.payload), idempotency_key=key)


def every_second(catch_up=1):
    return {"beat": Schedule("beat", "* * * * * *", "beat", {"n": 1}, catch_up=catch_up)}


def _racing_scheduler(url, barrier, out):
    broker = open_broker(url)
    sched = Scheduler(every_second(), new_job)
    got = sched.tick(broker, now=T0 - 0.5)  # a new schedule's first check: it starts from now
    for k in range(3):
        barrier.wait(20)
        got += sched.tick(broker, now=T0 + k)  # both schedulers, the same tick, at once
        barrier.wait(20)  # the test runs the jobs to done here
        barrier.wait(20)
        got += sched.tick(broker, now=T0 + k + 0.5)  # a late look at the same tick: its job is done
    broker.close()
    out.put([(name, tick, job_id) for name, tick, job_id in got])


def test_two_schedulers_enqueue_exactly_one_job_per_tick(broker, broker_url):
    ctx = multiprocessing.get_context("fork")
    barrier, out = ctx.Barrier(3), ctx.Queue()
    procs = [ctx.Process(target=_racing_scheduler, args=(broker_url, barrier, out)) for _ in range(2)]
    for p in procs:
        p.start()
    try:
        for _ in range(3):
            barrier.wait(20)
            barrier.wait(20)
            for job in broker.claim(["default"], 10, 30, "test"):
                broker.ack(job.lease)  # a fast job: done before anyone looks at its tick again
            barrier.wait(20)
        results = [out.get(timeout=30) for _ in procs]
    finally:
        for p in procs:
            p.join(10)
    created = [job_id for got in results for _, _, job_id in got if job_id is not None]
    assert len(created) == 3, results
    jobs = [broker.get(job_id) for job_id in created]
    assert sorted(j.idempotency_key for j in jobs) == [tick_key("beat", T0 + k) for k in range(3)]
    assert all(j.state == "done" and j.type == "beat" and j.payload == {"n": 1} for j in jobs)
    assert broker.stats(["default"])["default"].done == 3


def test_catch_up_enqueues_only_the_latest_missed_ticks(broker):
    keys = lambda got: [tick_key("beat", tick) for _, tick, job_id in got if job_id]  # noqa: E731
    assert broker.enqueue_once(new_job(every_second()["beat"], tick_key("beat", T0)), schedule="beat")  # ran at T0
    # Started after ten missed ticks: the latest one only (the default).
    sched = Scheduler(every_second(), new_job)
    assert keys(sched.tick(broker, now=T0 + 10.5)) == [tick_key("beat", T0 + 10)]
    assert sched.tick(broker, now=T0 + 10.9) == []  # nothing new is due
    # The loop was held up for three ticks: still the latest one only.
    assert keys(sched.tick(broker, now=T0 + 13.5)) == [tick_key("beat", T0 + 13)]
    # catch_up = 3: the three latest after the newest tick enqueued, oldest first.
    sched = Scheduler(every_second(catch_up=3), new_job)
    assert keys(sched.tick(broker, now=T0 + 17.5)) == [tick_key("beat", T0 + k) for k in (15, 16, 17)]
    # catch_up = 0: a fresh start skips what it missed, then follows the schedule.
    sched = Scheduler(every_second(catch_up=0), new_job)
    assert sched.tick(broker, now=T0 + 20.5) == []
    assert keys(sched.tick(broker, now=T0 + 21.2)) == [tick_key("beat", T0 + 21)]
    # Ticks older than the horizon (the retention that prunes enqueue_once records) are skipped.
    sched = Scheduler(every_second(catch_up=5), new_job, horizon=2.0)
    assert keys(sched.tick(broker, now=T0 + 40.5)) == [tick_key("beat", T0 + 39), tick_key("beat", T0 + 40)]


def test_schedule_in_a_time_zone_ticks_on_local_time():
    sched = Schedule("report", "0 9 * * *", "report", {}, timezone="Europe/Berlin")
    # 2026-07-01 12:00 UTC: the next 09:00 in Berlin (summer time, UTC+2) is 07:00 UTC the next day.
    assert tick_key("report", sched.next_after(1782907200.0)) == "cron:report:2026-07-02T07:00:00Z"


# -- config and decorator ------------------------------------------------------------

@pytest.mark.parametrize("data,error", [
    ({"jobs": {"types": {"x": {"rate_limit": "fast"}}}},
     'jobs.types.x.rate_limit: expected "N/s", "N/m" or "N/h", got "fast"'),
    ({"jobs": {"types": {"x": {"max_concurrency": 0}}}}, "jobs.types.x.max_concurrency: expected a positive integer"),
    ({"jobs": {"types": {"x": {"exclusive": "yes"}}}}, "jobs.types.x.exclusive: expected true or false"),
    ({"schedules": {"r": {"cron": "every day", "type": "t"}}}, "schedules.r.cron: expected a cron expression"),
    ({"schedules": {"r": {"type": "t"}}}, "schedules.r.cron: required"),
    ({"schedules": {"r": {"cron": "* * * * *"}}}, "schedules.r.type: required"),
    ({"schedules": {"r": {"cron": "* * * * *", "type": "t", "timezone": "Mars/Olympus"}}},
     "schedules.r.timezone: expected an IANA time zone name"),
    ({"schedules": {"r": {"cron": "* * * * *", "type": "t", "queue": "nope"}}},
     "schedules.r.queue: 'nope' is not in broker.queues"),
    ({"schedules": {"r": {"cron": "* * * * *", "type": "t", "every": 5}}}, "schedules.r.every: unknown key"),
    ({"schedules": {"r": {"cron": "* * * * *", "type": "t", "catch_up": 20000}}},
     "schedules.r.catch_up: expected an integer from 0 to 1000, got 20000"),
])
def test_config_errors_name_the_key_path(data, error):
    with pytest.raises(ConfigError) as info:
        config.from_dict(data)
    assert str(info.value).startswith(error)


def test_decorator_rejects_bad_values_and_the_config_overrides_it():
    with pytest.raises(ValueError, match="rate_limit"):
        supervisor.job("x", rate_limit="fast")
    with pytest.raises(ValueError, match="cron"):
        supervisor.job("x", cron="at noon")

    @supervisor.job("sync", max_concurrency=4, rate_limit="100/m", exclusive=True)
    def sync(ctx, payload):
        pass

    spec = registry.HandlerSpec(fn=sync, **getattr(sync, registry._MARK))
    cfg = config.from_dict({"jobs": {"types": {"sync": {"max_concurrency": 2}, "mail": {"rate_limit": "5/s"}}}})
    assert registry.type_limits(cfg, {"sync": spec}) == {
        "mail": TypeLimits(rate=(5, 1.0)),
        "sync": TypeLimits(max_concurrency=2, rate=(100, 60.0), exclusive=True),
    }
    assert registry.type_limits(config.from_dict({}), {}) == {}


def test_the_two_example_configs_are_identical_and_valid():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "config.example.toml")) as a, \
            open(os.path.join(root, "supervisor", "data", "config.example.toml")) as b:
        text = a.read()
        assert text == b.read()
    config.load(os.path.join(root, "config.example.toml"))
    # Uncommented, the commented examples are valid too: the new keys are spelled right there.
    lines = [line[2:] if line.startswith("# [") or re.match(r"^# [a-z_]+ = ", line) else line
             for line in text.splitlines(keepends=True)]
    cfg = config.from_dict(tomllib.loads("".join(lines)))
    assert registry.type_limits(cfg, {})["example"] == TypeLimits(4, (100, 60.0), True)
    assert cfg.schedules["nightly_report"].cron == "0 2 * * *"


def test_cli_lists_schedules_with_their_next_run(tmp_path):
    handlers = tmp_path / "handlers"
    handlers.mkdir()
    (handlers / "beat.py").write_text('import supervisor\n\n@supervisor.job("beat", cron="*/5 * * * *")\n'
                                      "def beat(ctx, payload):\n    pass\n")
    (tmp_path / "tangguh.toml").write_text('[schedules.report]\ncron = "0 9 * * 1-5"\ntype = "report"\n'
                                           'timezone = "Europe/Berlin"\npayload = {kind = "daily"}\n')
    done = tangguh("schedules", "--json", "-c", str(tmp_path / "tangguh.toml"))
    assert done.returncode == 0, done.stderr
    listing = {s["name"]: s for s in json.loads(done.stdout)}
    assert sorted(listing) == ["beat", "report"]
    assert listing["report"]["payload"] == {"kind": "daily"} and listing["report"]["timezone"] == "Europe/Berlin"
    assert listing["beat"]["next_run"] % 300 == 0
    text = tangguh("schedules", "-c", str(tmp_path / "tangguh.toml")).stdout
    assert "report" in text and "0 9 * * 1-5" in text and "NEXT_RUN" in text


# -- real supervisors ----------------------------------------------------------------

def test_two_supervisors_on_one_broker_enqueue_one_job_per_tick(tmp_path):
    url = f"sqlite:///{tmp_path}/shared.db"
    schedules = {"beat": {"cron": "* * * * * *", "type": "noop", "catch_up": 0}}
    daemons = [Daemon(tmp_path / name, broker_url=url, schedules=schedules) for name in ("a", "b")]
    try:
        for d in daemons:
            d.start()
        broker = daemons[0].broker

        def beats():
            return [j for j in (broker.get(i) for i in _ids(broker)) if j.idempotency_key.startswith("cron:beat:")]

        wait_for(lambda: len({j.idempotency_key for j in beats() if j.state == "done"}) >= 3, timeout=20,
                 message="three ticks run")
        for d in daemons:
            d.signal(signal.SIGTERM)
        for d in daemons:
            assert d.wait_exit() == 0
        got = beats()
        keys = [j.idempotency_key for j in got]
        assert len(keys) == len(set(keys)) >= 3, keys  # one job per tick, never two
        assert {j.state for j in got} == {"done"}
        owners = {h["owner"].split(":")[1] for j in got for h in j.history}  # host:pid:suffix
        assert owners <= {str(d.proc.pid) for d in daemons}
        for d in daemons:
            d.assert_clean()
    finally:
        for d in daemons:
            d.stop()


def _ids(broker):
    return [row[0] for row in broker.db.execute("SELECT id FROM jobs WHERE idempotency_key IS NOT NULL")]


def test_supervisor_passes_type_limits_to_the_broker(tmp_path):
    d = Daemon(tmp_path, jobs={"types": {"hold": {"max_concurrency": 1}}})
    release = d.marker("release")
    marker = d.marker("hold.log")
    try:
        d.start()
        ids = [d.enqueue("hold", {"release": release, "marker": marker}) for _ in range(2)]
        wait_for(lambda: os.path.exists(marker), message="the first job to start")
        states = sorted(d.job(i).state for i in ids)
        assert states == ["queued", "running"]
        busy = [w for w in d.status()["workers"] if w["state"] == "busy"]
        assert len(busy) == 1  # the second worker is idle: the broker held the job back
        open(release, "w").close()
        for job_id in ids:
            assert d.wait_job(job_id).state == "done"
        d.signal(signal.SIGTERM)
        assert d.wait_exit() == 0
        d.assert_clean()
    finally:
        d.stop()


def test_a_schedule_that_cannot_build_its_job_is_skipped_not_fatal(broker):
    from supervisor.errors import BadInput

    def refuse(sched, key):
        if sched.name == "bad":
            raise BadInput("queue 'nope' is not served")
        return new_job(sched, key)

    schedules = dict(every_second(), bad=Schedule("bad", "* * * * * *", "t", {}))
    sched = Scheduler(schedules, refuse)
    assert sched.tick(broker, now=T0 - 0.5) == []  # new schedules start from now
    got = sched.tick(broker, now=T0 + 0.5)
    assert [(name, job_id is not None) for name, _, job_id in got] == [("beat", True)]


def test_a_tick_whose_job_is_refused_is_logged_once_not_at_every_tick(broker, caplog):
    """A decorator's queue this supervisor does not serve passes the load check (another supervisor
    sharing the handlers may serve it and enqueue the ticks); here each tick's job is refused.
    That was logged at every tick, every second for some schedules: now once."""
    from supervisor import scheduler

    spec = registry.HandlerSpec(type="report", fn=print, queue="slow", cron="* * * * * *")
    cfg = config.from_dict({})
    scheduler.check_schedules(cfg, {"report": spec})
    sched = scheduler.from_config(cfg, {"report": spec})
    with caplog.at_level("ERROR", logger="tangguh.scheduler"):
        got = [job_id for k in range(4) for _, _, job_id in sched.tick(broker, now=T0 + k + 0.5)]
    assert got == []
    failed = [r.getMessage() for r in caplog.records if getattr(r, "event", None) == "schedule_failed"]
    assert len(failed) == 1 and "cannot enqueue: queue 'slow' is not one of" in failed[0], failed


def test_a_schedule_that_recovers_has_its_next_failure_logged_again(broker, caplog):
    """The once-only log of a failing schedule kept its last failure after the schedule
    recovered, so the same failure coming back later was never logged."""
    from supervisor import scheduler
    from supervisor.errors import BadInput

    sched = Scheduler(every_second(), None)
    good = {0, 1, 3}  # ticks T0+0, +1 and +3 enqueue; +2 and +4 are refused alike

    def new_job(schedule, key):
        if round(scheduler.key_tick("beat", key) - T0) not in good:
            raise BadInput("refused for this test")
        return NewJob(schedule.type, {}, idempotency_key=key)

    sched.new_job = new_job
    with caplog.at_level("ERROR", logger="tangguh.scheduler"):
        for k in range(5):
            sched.tick(broker, now=T0 + k + 0.5)
    failed = [r for r in caplog.records if getattr(r, "event", None) == "schedule_failed"]
    assert len(failed) == 2, [r.getMessage() for r in failed]


def test_a_wall_clock_step_forward_is_seen_at_the_next_clock_check(tmp_path, monkeypatch):
    """The wait until the next tick ran on the monotonic clock, computed once from the broker's
    time: after a wall-clock step forward (NTP, a VM resumed) an hourly tick came up to an
    hour late, a daily one a day late. The broker's clock is read again at least every
    ``CLOCK_CHECK_SECONDS`` (shortened here)."""
    from supervisor.backends.sqlite import SQLiteBroker
    from supervisor.master import periodic

    class SteppedClock(SQLiteBroker):
        step = 0.0

        def now(self):
            return super().now() + self.step

    broker = SteppedClock(f"sqlite:///{tmp_path}/broker.db")
    broker.migrate()
    cfg = config.from_dict({"schedules": {"hourly": {"cron": "0 * * * *", "type": "t", "catch_up": 0}}})
    link = type("Link", (), {"down": False, "call": lambda self, fn, what=None: fn(broker)})()
    monkeypatch.setattr(periodic, "CLOCK_CHECK_SECONDS", 0.05)
    chores = periodic.Periodic(cfg, {}, link)
    now = broker.now()
    broker.step = 3600 - now % 3600 - 30  # half a minute before the hour
    chores.run_schedules()
    assert broker.stats(["default"])["default"].ready == 0
    broker.step += 60  # the wall clock steps a minute forward: the hour is past
    wait_for(lambda: chores.run_schedules() or broker.stats(["default"])["default"].ready == 1, timeout=10,
             message="the tick of the hour enqueued after the step")
    broker.close()


# -- schedules the config gets wrong ------------------------------------------------

def test_a_decorator_schedule_goes_to_the_queue_the_config_gives_its_type(tmp_path):
    """``@job("report", queue="slow", cron=...)`` with ``[jobs.types.report] queue = "reports"``:
    the schedule enqueued to "slow" (or, "slow" not served, failed every tick) while
    ``report.enqueue()`` used "reports". The config overrides the decorator for both."""
    from supervisor import scheduler

    spec = registry.HandlerSpec(type="report", fn=print, queue="slow", cron="* * * * * *")
    broker = open_broker(f"sqlite:///{tmp_path}/broker.db")
    broker.migrate()
    try:
        for queues in (["default", "reports"], ["default", "reports", "slow"]):
            cfg = config.from_dict({"broker": {"queues": queues}, "jobs": {"types": {"report": {"queue": "reports"}}}})
            sched = scheduler.from_config(cfg, {"report": spec})
            # A schedule's first check only starts it (nothing to catch up): the tick after it enqueues.
            got = sched.tick(broker, now=T0 + 10 * len(queues) + 0.5)
            got += sched.tick(broker, now=T0 + 10 * len(queues) + 1.5)
            queued = {broker.get(job_id).queue for _, _, job_id in got if job_id}
            assert queued == {"reports"}, queues
            assert [s["queue"] for s in sched.listing(T0)] == ["reports"]
        # Without an override the decorator's queue still applies.
        cfg = config.from_dict({"broker": {"queues": ["default", "slow"]}})
        sched = scheduler.from_config(cfg, {"report": spec})
        got = sched.tick(broker, now=T0 + 90.5) + sched.tick(broker, now=T0 + 91.5)
        assert {broker.get(job_id).queue for _, _, job_id in got if job_id} == {"slow"}
    finally:
        broker.close()


def test_a_config_schedule_without_a_queue_goes_to_its_types_queue(tmp_path):
    """``[schedules.nightly] type = "rep"`` with ``@job("rep", queue="reports")``: its ticks went to
    "default" (``tangguh schedules`` said queue null) while ``rep.enqueue()`` and a decorator's
    ``cron=`` used "reports". The schedule's own queue, else the config's for its type, else the
    decorator's: the daemon's ticks and the listing agree."""
    from supervisor import scheduler

    handlers = tmp_path / "handlers"
    handlers.mkdir()
    (handlers / "rep.py").write_text('import supervisor\n\n@supervisor.job("rep", queue="reports")\n'
                                     "def rep(ctx, payload):\n    pass\n")
    data = {"supervisor": {"handlers": str(handlers)},
            "broker": {"url": f"sqlite:///{tmp_path}/broker.db", "queues": ["default", "reports", "slow"]},
            "jobs": {"types": {"typed": {"queue": "slow"}}},
            "schedules": {"nightly": {"cron": "* * * * * *", "type": "rep"},
                          "pinned": {"cron": "* * * * * *", "type": "rep", "queue": "default"},
                          "typed": {"cron": "* * * * * *", "type": "typed"},
                          "plain": {"cron": "* * * * * *", "type": "plain"}}}
    expected = {"nightly": "reports", "pinned": "default", "typed": "slow", "plain": "default"}
    with open(tmp_path / "tangguh.toml", "wb") as f:
        tomli_w.dump(data, f)
    done = tangguh("schedules", "--json", "-c", str(tmp_path / "tangguh.toml"))
    assert done.returncode == 0, done.stderr
    assert {s["name"]: s["queue"] for s in json.loads(done.stdout)} == dict(expected, plain=None)
    cfg = config.load(str(tmp_path / "tangguh.toml"))
    sched = scheduler.from_config(cfg, registry.load_handlers(str(handlers)))  # as the master builds it
    broker = open_broker(cfg.broker.url)
    broker.migrate()
    try:
        got = sched.tick(broker, now=T0 + 0.5) + sched.tick(broker, now=T0 + 1.5)
        assert {name: broker.get(job_id).queue for name, _, job_id in got if job_id} == expected
    finally:
        broker.close()


def test_a_schedule_whose_cron_fails_is_skipped_alone_and_logged_once(broker, caplog):
    """A cron with no past tick (a year still to come) made croniter raise inside the master's
    periodic chore; the broker link read that as an outage and paused every claim, every
    second. Its error is now the schedule's: logged once, the other schedules go on."""
    schedules = dict(every_second(), future=Schedule("future", "0 9 1 1 * 0 2030", "t", {}))  # T0: 2027
    sched = Scheduler(schedules, new_job)
    # Checked before (not a new schedule): this check looks back for ticks, which this cron has none of.
    sched.checked["future"] = T0 - 10
    with caplog.at_level("ERROR", logger="tangguh.scheduler"):
        got = sched.tick(broker, now=T0 + 0.5) + sched.tick(broker, now=T0 + 1.5)
    # The first check starts "beat" (a new schedule catches nothing up); the next tick enqueues.
    assert [(name, tick) for name, tick, job_id in got if job_id] == [("beat", T0 + 1)]
    failed = [r for r in caplog.records if getattr(r, "event", None) == "schedule_failed"]
    assert [r.schedule for r in failed] == ["future"], caplog.text
    assert sched.due_at() == T0 + 2  # the next beat; "future" waits for its 2030 tick


SCHEMA_HANDLER = '''import dataclasses

import supervisor


@dataclasses.dataclass
class Report:
    region: str


@supervisor.job("report", payload=Report{cron})
def report(ctx, payload):
    pass
'''


def _bad_schedule(d, case):
    """Make ``d``'s config or handlers hold a schedule of ``case``; the error expected."""
    next_year = datetime.date.today().year + 1
    long = "s" * 235  # a valid name and type; its tick key, cron:<name>:<20 characters>, is 261 long
    schedules = {"year": {"cron": f"0 9 1 1 * 0 {next_year}", "type": "noop"},
                 "random": {"cron": "R * * * *", "type": "noop"},
                 "payload": {"cron": "0 0 1 1 *", "type": "report", "payload": {"kind": "daily"}},
                 "long_name": {"cron": "* * * * * */2", "type": "noop"}}
    (d.handlers_path / "report.py").write_text(SCHEMA_HANDLER.format(
        cron=', cron="0 0 1 1 *"' if case == "decorator_payload" else ""))
    if case == "decorator_long_name":
        (d.handlers_path / "long.py").write_text(f'import supervisor\n\n@supervisor.job("{long}", cron="* * * * * */2")'
                                                 "\ndef long(ctx, payload):\n    pass\n")
    if case in schedules:
        d.config["schedules"] = {long if case == "long_name" else "bad": schedules[case]}
        d.write_config()
    too_long = "every tick's job would be refused: idempotency_key is 261 characters long, more than 255"
    return {"year": "schedules.bad.cron: no tick before now",
            "random": "schedules.bad.cron: H and R (hashed and random values) are not supported",
            "payload": "schedules.bad.payload: kind: unknown field of Report",
            "decorator_payload": "job 'report': cron= enqueues payload {}, which its payload schema refuses:"
                                 " region: missing (expected str)",
            "long_name": f"schedules.{long}: {too_long}",
            "decorator_long_name": f"long.py: job '{long}': cron=: {too_long}"}[case]


@pytest.mark.parametrize("case", ["year", "random", "payload", "decorator_payload", "long_name",
                                  "decorator_long_name"])
def test_run_and_config_check_refuse_a_schedule_that_cannot_run(tmp_path, case):
    """Each passed `config check` and started: a cron with no past tick paused every claim, an R
    (random) minute moved on every check and on every supervisor, a payload the handler's
    schema refuses dead-lettered every tick, and a name making the tick key longer than 255
    characters stored nothing, logging the refusal every tick. A one-line error naming the
    schedule, exit 2."""
    d = Daemon(tmp_path)
    d.handlers_path = tmp_path / "handlers"
    said = _bad_schedule(d, case)
    check = tangguh("config", "check", "-c", d.config_path)
    assert check.returncode == 2 and check.stdout == "", check.stdout
    assert said in check.stderr and check.stderr.count("\n") == 1, check.stderr
    try:
        d.start(wait=False)
        code = wait_for(lambda: d.proc.poll() is not None and str(d.proc.returncode), timeout=30,
                        message="run to refuse the config")
        assert code == "2" and said in d.logs(), d.logs()
    finally:
        d.stop()


@pytest.mark.parametrize("case", ["year", "random", "payload", "long_name", "decorator_long_name"])
def test_a_reload_to_a_schedule_that_cannot_run_keeps_the_running_generation(tmp_path, case):
    d = Daemon(tmp_path)
    d.handlers_path = tmp_path / "handlers"
    try:
        d.start()
        said = _bad_schedule(d, case)
        d.signal(signal.SIGHUP)
        wait_for(lambda: d.status()["reload_error"], timeout=30, message="reload_error to be reported")
        status = d.status()
        assert said in status["reload_error"] and status["generation"] == 1, status["reload_error"]
        assert d.wait_job(d.enqueue("noop")).state == "done"  # still serving
        d.signal(signal.SIGTERM)
        assert d.wait_exit() == 0
    finally:
        d.stop()


def _clocked_chores(tmp_path, monkeypatch, schedules):
    """A ``Periodic`` on a SQLite broker whose clock the test sets (``broker.t``), checked every call."""
    from supervisor.backends.sqlite import SQLiteBroker
    from supervisor.master import periodic

    class SetClock(SQLiteBroker):
        t = T0

        def now(self):
            return self.t

    broker = SetClock(f"sqlite:///{tmp_path}/broker.db")
    broker.migrate()
    cfg = config.from_dict({"schedules": schedules})
    link = type("Link", (), {"down": False, "call": lambda self, fn, what=None: fn(broker)})()
    monkeypatch.setattr(periodic, "CLOCK_CHECK_SECONDS", 0.0)  # every run_schedules() checks
    return broker, cfg, periodic.Periodic(cfg, {}, link)


def _once_keys(broker):
    return sorted(k for (k,) in broker.db.execute("SELECT key FROM once_keys"))


def test_a_reload_keeps_the_last_check_of_an_unchanged_schedule(tmp_path, monkeypatch):
    """A reload built a new scheduler that forgot its last check: with ``catch_up = 0`` the tick
    due while the reload ran (handlers importing) was never enqueued."""
    broker, cfg, chores = _clocked_chores(tmp_path, monkeypatch, {
        "beat": {"cron": "* * * * * */5", "type": "t", "catch_up": 0}})
    broker.t = T0 + 0.5
    chores.run_schedules()  # the first check: the tick at T0 is before the schedule's time
    broker.t = T0 + 5.5
    chores.run_schedules()
    assert _once_keys(broker) == [tick_key("beat", T0 + 5)]
    broker.t = T0 + 10.5  # the tick at T0 + 10 falls while the handlers are imported
    chores.configure(cfg, {})  # the reload, same config
    chores.run_schedules()
    assert _once_keys(broker) == [tick_key("beat", T0 + 5), tick_key("beat", T0 + 10)]
    broker.close()


def test_a_new_schedule_starts_from_now_and_a_changed_one_from_its_newest_tick(broker):
    """A schedule never seen before enqueued its latest ``catch_up`` ticks at once, all from
    before it existed (5 at the first start of an hourly schedule with catch_up = 5), and a
    reload moving it from :00 to :30 as many again."""
    hour = 3600.0
    keys = lambda got: [tick_key("report", tick) for _, tick, job_id in got if job_id]  # noqa: E731
    hourly = {"report": Schedule("report", "0 * * * *", "report", {}, catch_up=5)}
    sched = Scheduler(hourly, new_job)
    assert sched.tick(broker, now=T0 + 10 * hour + 600) == []  # new: nothing from before it existed
    assert keys(sched.tick(broker, now=T0 + 11 * hour + 1)) == [tick_key("report", T0 + 11 * hour)]
    # A reload moves it to minute 30: only ticks after its newest one (11:00) may be caught up.
    moved = {"report": Schedule("report", "30 * * * *", "report", {}, catch_up=5)}
    assert keys(Scheduler(moved, new_job).tick(broker, now=T0 + 11 * hour + 2400)) == \
        [tick_key("report", T0 + 11 * hour + 1800)]
    # Every supervisor down over three ticks: the first one back catches up all three.
    assert keys(Scheduler(moved, new_job).tick(broker, now=T0 + 14 * hour + 2400)) == \
        [tick_key("report", T0 + h * hour + 1800) for h in (12, 13, 14)]


def test_one_tick_call_enqueues_at_most_its_budget_and_the_rest_stays_due(broker):
    """A per-second schedule with a large catch_up enqueued every missed tick in one call (20,000
    jobs blocked the master's loop 24 s)."""
    from supervisor.scheduler import TICKS_PER_CALL

    broker.enqueue_once(new_job(every_second()["beat"], tick_key("beat", T0)), schedule="beat")
    sched = Scheduler(every_second(catch_up=1000), new_job)
    now = T0 + 1000.5
    got = sched.tick(broker, now=now)
    assert len(got) == TICKS_PER_CALL < 1000
    assert [tick for _, tick, _ in got] == [T0 + k for k in range(1, TICKS_PER_CALL + 1)]  # the oldest first
    assert sched.due_at() <= now  # the rest: due at once
    calls = 1
    while sched.due_at() <= now:
        got += sched.tick(broker, now=now)
        calls += 1
    assert sorted(tick for _, tick, job_id in got if job_id) == [T0 + k for k in range(1, 1001)]
    assert calls == 1000 // TICKS_PER_CALL


def test_a_fixed_time_schedule_runs_once_on_the_night_the_clocks_go_back(broker):
    """On the DST fall-back night 02:00 comes twice; ``0 2 * * *`` ran at both (two UTC instants,
    two tick keys). A fixed-time schedule runs once per wall-clock time, as vixie cron does;
    wildcard-hour and wildcard-minute schedules follow the clock and run in both hours."""
    import datetime
    import zoneinfo

    berlin = zoneinfo.ZoneInfo("Europe/Berlin")

    def local(tick):
        return datetime.datetime.fromtimestamp(tick, berlin).isoformat()

    def run(cron, start, hours):
        name = f"x{start.month}{cron}"  # tick keys of its own
        sched = Scheduler({name: Schedule(name, cron, "t", {}, timezone="Europe/Berlin")}, new_job)
        t = start.timestamp()
        sched.tick(broker, now=t)
        out = []
        while sched.due_at() < start.timestamp() + hours * 3600:
            t = sched.due_at() + 0.5
            out += [local(tick) for _, tick, job_id in sched.tick(broker, now=t) if job_id]
        return out

    fall = datetime.datetime(2026, 10, 24, 12, tzinfo=berlin)
    assert run("0 2 * * *", fall, 48) == ["2026-10-25T02:00:00+02:00", "2026-10-26T02:00:00+01:00"]
    assert run("30 2 * * * 15", fall, 48) == ["2026-10-25T02:30:15+02:00", "2026-10-26T02:30:15+01:00"]
    assert run("0 3 * * *", fall, 48) == ["2026-10-25T03:00:00+01:00", "2026-10-26T03:00:00+01:00"]
    hourly = [x for x in run("0 * * * *", fall, 16) if "T02:" in x]
    assert hourly == ["2026-10-25T02:00:00+02:00", "2026-10-25T02:00:00+01:00"]  # by the clock: both hours
    assert run("*/30 2 * * *", fall, 24) == ["2026-10-25T02:00:00+02:00", "2026-10-25T02:30:00+02:00",
                                             "2026-10-25T02:00:00+01:00", "2026-10-25T02:30:00+01:00"]
    spring = datetime.datetime(2026, 3, 28, 12, tzinfo=berlin)  # 02:00 does not exist: 03:00 instead
    assert run("0 2 * * *", spring, 48) == ["2026-03-29T03:00:00+02:00", "2026-03-30T02:00:00+02:00"]


def test_an_hourly_macro_in_any_case_follows_the_clock_when_it_goes_back():
    """``@HOURLY`` (accepted by the config check, hourly to croniter) was read as a fixed-time
    schedule on the fall-back night: the repeated 02:00 hour was skipped, which ``@hourly`` runs."""
    import zoneinfo

    berlin = zoneinfo.ZoneInfo("Europe/Berlin")
    start = datetime.datetime(2026, 10, 25, 1, 30, tzinfo=berlin).timestamp()
    both = ["02:00:00+02:00", "02:00:00+01:00", "03:00:00+01:00"]
    for cron in ("@hourly", "@HOURLY", "@Hourly"):
        s = Schedule("s", cron, "t", {}, timezone="Europe/Berlin")
        ticks, t = [], start
        for _ in range(3):
            t = s.next_after(t)
            ticks.append(t)
        assert [datetime.datetime.fromtimestamp(x, berlin).isoformat()[11:] for x in ticks] == both, cron
        assert s.latest(ticks[-1], 3) == ticks, cron  # the catch-up's look back sees both hours too


# -- the look-back: each schedule's own record of its newest tick ------------------------------

def _utc(*args):
    return datetime.datetime(*args, tzinfo=datetime.timezone.utc).timestamp()


def test_a_schedule_longer_than_the_retention_catches_up_after_its_once_records_were_pruned(broker):
    """A monthly schedule, retention 7 days: last month's once-record is pruned, every supervisor
    is down over this month's tick, the first one back a minute later enqueued nothing (a
    schedule without a once-record looked new)."""
    keys = lambda got: [tick_key("billing", tick) for _, tick, job_id in got if job_id]  # noqa: E731
    nov, dec = _utc(2026, 11, 1), _utc(2026, 12, 1)
    monthly = {"billing": Schedule("billing", "0 0 1 * *", "bill", {})}
    first = Scheduler(monthly, new_job, horizon=7 * 86400.0)
    assert first.tick(broker, now=nov - 60) == []  # new: it starts from now
    assert keys(first.tick(broker, now=nov + 1)) == [tick_key("billing", nov)]
    broker.prune(-1)  # every once-record is gone, as the retention prunes them
    restarted = Scheduler(monthly, new_job, horizon=7 * 86400.0)
    assert keys(restarted.tick(broker, now=dec + 60)) == [tick_key("billing", dec)]


def test_a_once_key_under_a_schedules_prefix_that_is_no_tick_never_fails_its_check(broker, caplog):
    """``cron:nightly:manual`` (an operator's enqueue_once) made the look-back raise ValueError
    inside tick(): the broker link read it as an outage and paused every claim, for good."""
    broker.enqueue_once(NewJob("t", {}, idempotency_key="cron:nightly:manual"))
    nightly = {"nightly": Schedule("nightly", "0 3 * * *", "t", {})}
    sched = Scheduler(nightly, new_job)
    assert sched.tick(broker, now=T0) == []
    assert sched.due_at() > T0
    # A schedule's record that is no tick of its own (not the scheduler's): started from now, logged.
    broker.enqueue_once(NewJob("t", {}, idempotency_key="cron:weekly:manual"), schedule="weekly")
    weekly = {"weekly": Schedule("weekly", "0 3 * * 1", "t", {})}
    sched = Scheduler(weekly, new_job)
    assert sched.tick(broker, now=T0) == [] and sched.due_at() > T0
    assert [r.schedule for r in caplog.records if getattr(r, "event", None) == "schedule_failed"] == ["weekly"]


def test_a_schedule_looks_back_to_its_own_ticks_not_those_of_a_name_it_prefixes(broker):
    """``report`` read the newest record under ``cron:report:``, which was ``report:eu``'s newer
    tick: it looked back from the wrong tick and missed its own."""
    day = 86400.0
    d0 = _utc(2026, 11, 30)
    daily = lambda name: {name: Schedule(name, "0 0 * * *", "t", {}, catch_up=5)}  # noqa: E731
    report = Scheduler(daily("report"), new_job)
    report.tick(broker, now=d0 - 60)
    assert [job_id is not None for _, _, job_id in report.tick(broker, now=d0 + 1)] == [True]
    eu = Scheduler(daily("report:eu"), new_job)
    eu.tick(broker, now=d0 + day - 60)
    assert [job_id is not None for _, _, job_id in eu.tick(broker, now=d0 + day + 1)] == [True]
    restarted = Scheduler(daily("report"), new_job)  # report's supervisors were down over d0 + 1 day
    assert [(name, tick) for name, tick, job_id in restarted.tick(broker, now=d0 + day + 3600) if job_id] == \
        [("report", d0 + day)]


def test_the_look_back_reads_its_schedules_record_by_name_without_a_scan(broker, monkeypatch):
    """Redis scanned every once-record of every queue per schedule on the master's main loop
    (358 ms a schedule at 200,000 records); PostgreSQL a sequential scan of once_keys."""
    for k in range(50):
        broker.enqueue_once(NewJob("t", {}, idempotency_key=f"order:{k}"))
    seen = []
    kind = type(broker).__module__.split(".")[-1]
    if kind == "redis":
        class Spy:
            def __getattr__(self, name):
                seen.append(name)
                return getattr(real, name)
        real = broker.r
        monkeypatch.setattr(broker, "r", Spy())
    elif kind == "postgres":
        execute = broker._execute
        monkeypatch.setattr(broker, "_execute", lambda query, *a, **kw: seen.append(query) or execute(query, *a, **kw))
    else:
        broker.db.set_trace_callback(seen.append)
    Scheduler(every_second(), new_job).tick(broker, now=T0)
    if kind == "sqlite":
        broker.db.set_trace_callback(None)
        seen = [s for s in seen if s.startswith("SELECT")]
    if kind == "redis":
        assert seen == ["hget"]
    else:
        assert len(seen) == 1 and re.search(r"FROM \S*schedule_ticks WHERE name = ", seen[0]), seen


@pytest.mark.parametrize("backend", ["redis", "postgres"])
def test_a_wall_clock_step_forward_after_the_broker_clock_was_read_fires_no_tick_early(
        backend, request, monkeypatch):
    """The Redis and PostgreSQL brokers' ``now()`` was the local wall clock plus the server's
    offset, read again only every 30 (60) s. A local clock that was behind (a VM restored from a
    snapshot) and then stepped forward (NTP, the guest agent) took ``now()`` that far past the
    server's clock until the next read: a check then enqueued a daily tick an hour early, and the
    ticks in between were never enqueued. The offset is now from the monotonic clock, which no
    wall-clock step moves."""
    import time as real_time

    from supervisor.backends import open_broker

    broker = open_broker(request.getfixturevalue(f"{backend}_url"))
    broker.migrate()
    wall = real_time.time
    monkeypatch.setattr(real_time, "time", lambda: wall() - 3600)  # the local clock an hour behind
    true_now = broker.now()  # the broker reads the server's clock: right, whatever ours says
    # A daily tick 30 minutes from now (UTC): none of its ticks falls within the next minutes.
    soon = datetime.datetime.fromtimestamp(true_now + 1800, datetime.timezone.utc)
    sched = Scheduler({"daily": Schedule("daily", f"{soon.minute} {soon.hour} * * *", "t", {})}, new_job)
    sched.tick(broker)  # a new schedule's first check: it starts from now
    monkeypatch.setattr(real_time, "time", wall)  # the local clock steps an hour forward, corrected
    assert sched.tick(broker) == []  # the tick half an hour ahead is not due
    assert broker.now() < true_now + 600
    broker.close()
