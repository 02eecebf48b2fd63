"""Metrics, logs and supervisor events of a real daemon, plus the exporter's pieces.

One daemon (module fixture) runs jobs that succeed, retry, die, time out,
crash, lose their lease, report toolkit counters, and sees a good and a bad
reload. The tests then read its ``/metrics`` over HTTP and the health socket
and its JSON log.
"""
import json
import os
import re
import selectors
import shutil
import subprocess
import signal
import socket
import sqlite3
import urllib.request

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from supervisor import heartbeat, metrics, toolkit
from supervisor.backends import open_broker
from supervisor.health import request
from supervisor.metrics import HttpExporter, Metrics
from supervisor.model import Job, NewJob

from .daemon import Daemon, read_lines, tangguh
from .util import wait_for

DELTAS = {"duplicates_suppressed": 1, "lock_acquired": 2, "lock_failed": 1, "lock_wait_seconds": 0.25,
          "cache_hit": 3, "cache_miss": 1, "cache_rebuild": 1, "cache_stale_served": 1, "not_a_metric": 7}


def samples(text):
    """{(sample name, ((label, value), ...)): value} of an exposition; it must parse."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(scrape, name, **labels):
    return scrape.get((name, tuple(sorted(labels.items()))), 0.0)


def counters_only(scrape):
    return {k: v for k, v in scrape.items() if k[0].endswith(("_total", "_count"))
            and not k[0].startswith(("process_", "tangguh_broker_round_trip", "tangguh_lease_extensions",
                                     "tangguh_heartbeat_errors"))}


def http_get(url, data=None):
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.status, resp.headers.get("Content-Type"), resp.read().decode()


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    """Run the whole scenario once; yield (daemon, job ids)."""
    tmp = tmp_path_factory.mktemp("metrics")
    app_db = f"sqlite:///{tmp}/app.db"
    toolkit.migrate(app_db)
    d = Daemon(tmp, metrics={"listen": "127.0.0.1:0"}, toolkit={"database_url": app_db})
    try:
        d.start()
        ids = {}
        ids["noop"] = [d.enqueue("noop", {"i": i}, resource_id=f"r{i}", idempotency_key=f"k{i}") for i in range(3)]
        ids["suicide"] = d.enqueue("suicide", {"crashes": 1})
        ids["poison"] = d.enqueue("poison", {}, max_attempts=2)
        ids["permanent"] = d.enqueue("permanent", {})
        ids["spin"] = d.enqueue("spin", {}, timeout=1.0, max_attempts=1)
        ids["soft"] = d.enqueue("soft_timeout", {}, max_attempts=1)
        ids["metered"] = [d.enqueue("metered", {"metrics": DELTAS}),
                          d.enqueue("metered", {"metrics": DELTAS, "fail": True})]
        # A real duplicate: the effect commits, the child dies before replying, the re-run finds the key done.
        ids["once"] = d.enqueue("effect_once", {"key": "invoice-7", "marker": d.marker("effect")})
        d.enqueue("noop", {}, delay=3600)
        for job_id in [*ids["noop"], *ids["metered"], ids["suicide"], ids["poison"], ids["permanent"], ids["spin"],
                       ids["soft"], ids["once"]]:
            d.wait_job(job_id)
        assert read_lines(d.marker("effect")) == [["effect", "1"]]
        assert d.job(ids["once"]).result == {"duplicate": True}

        # A lease taken over by someone else: bump the fencing token under the running job.
        marker, release = d.marker("hold"), d.marker("release")
        ids["hold"] = d.enqueue("hold", {"marker": marker, "release": release})
        wait_for(lambda: read_lines(marker), message="hold to start")
        with sqlite3.connect(os.path.join(d.dir, "broker.db"), timeout=10) as db:
            db.execute("UPDATE jobs SET token = token + 1 WHERE id = ?", (ids["hold"],))
        wait_for(lambda: d.status()["counters"]["lease_lost"] == 1, message="the heartbeat to see the lost lease")
        open(release, "w").close()
        # The stolen lease runs out; the broker reclaims the job (a visibility-timeout expiry) and it runs again.
        assert d.wait_job(ids["hold"], timeout=30).state == "done"

        d.signal(signal.SIGHUP)
        wait_for(lambda: d.status()["generation"] == 2 and d.ready(), message="the reload")
        d.config["supervisor"]["workers"] = "two"
        d.write_config()
        d.signal(signal.SIGHUP)
        wait_for(lambda: d.status()["reload_error"], message="the failed reload")
        d.config["supervisor"]["workers"] = 2
        d.write_config()  # good again for the CLI (no HUP: the counters stay as they are)
        # Queue gauges come from a timer sample: wait for one taken after the last job ended.
        wait_for(lambda: d.status()["queues"].get("default", {}).get("dead") == 5 and
                 d.status()["queues"]["default"]["in_flight"] == 0, timeout=20, message="a fresh queue sample")
        yield d, ids
        d.signal(signal.SIGTERM)
        assert d.wait_exit() == 0
        d.assert_clean()
    finally:
        d.stop()


def test_every_counter_over_http_and_the_socket(ran):
    d, ids = ran
    address = d.status()["metrics_listen"]
    status, ctype, text = http_get(f"http://{address}/metrics")
    assert status == 200 and ctype.startswith("text/plain; version=0.0.4")
    http = samples(text)
    cli = tangguh("metrics", "-c", d.config_path)
    assert cli.returncode == 0, cli.stderr
    sock = samples(cli.stdout)
    assert counters_only(http) == counters_only(sock)

    m = lambda name, **labels: value(http, name, queue="default", **labels)  # noqa: E731
    assert m("tangguh_jobs_succeeded_total", type="noop") == 3
    assert m("tangguh_jobs_succeeded_total", type="suicide") == 1
    assert m("tangguh_jobs_succeeded_total", type="hold") == 1
    assert m("tangguh_jobs_succeeded_total", type="effect_once") == 1
    assert m("tangguh_jobs_claimed_total", type="hold") == 2
    # retry: the crash is retried, poison once then dead
    assert m("tangguh_jobs_retried_total", type="suicide", reason="crashed") == 1
    assert m("tangguh_jobs_retried_total", type="effect_once", reason="crashed") == 1
    assert m("tangguh_jobs_retried_total", type="poison", reason="exception") == 1
    assert m("tangguh_jobs_failed_total", type="poison", reason="exception") == 2
    # die
    assert m("tangguh_jobs_dead_lettered_total", type="poison", reason="exception") == 1
    assert m("tangguh_jobs_dead_lettered_total", type="permanent", reason="permanent") == 1
    assert m("tangguh_jobs_dead_lettered_total", type="spin", reason="timeout") == 1
    assert m("tangguh_jobs_dead_lettered_total", type="soft_timeout", reason="timeout") == 1
    assert m("tangguh_jobs_dead_lettered_total", type="metered", reason="permanent") == 1
    # time out, soft and hard
    assert m("tangguh_timeouts_total", type="spin", kind="hard") == 1
    assert m("tangguh_timeouts_total", type="soft_timeout", kind="soft") == 1
    assert m("tangguh_timeouts_total", type="spin", kind="soft") == 0
    # crash, lost lease, expiry: the crash, the timeout kill and the lease-lost kill were replaced
    assert value(http, "tangguh_children_crashed_total", when="mid_job") == 2
    assert value(http, "tangguh_children_crashed_total", when="idle") == 0
    assert value(http, "tangguh_children_restarted_total") == 4
    assert value(http, "tangguh_leases_lost_total") == 1
    assert m("tangguh_lease_expiries_total", type="hold") == 1
    assert value(http, "tangguh_reloads_total", result="ok") == 1
    assert value(http, "tangguh_reloads_total", result="failed") == 1
    # duplicates: one real (the idempotency record), two reported by the metered jobs
    assert m("tangguh_duplicates_suppressed_total", type="effect_once") == 1
    # toolkit deltas from two jobs (one failed), the unknown key ignored
    assert m("tangguh_duplicates_suppressed_total", type="metered") == 2
    assert m("tangguh_lock_acquired_total", type="metered") == 4
    assert m("tangguh_lock_failed_total", type="metered") == 2
    assert m("tangguh_lock_wait_seconds_total", type="metered") == 0.5
    assert m("tangguh_cache_hits_total", type="metered") == 6
    assert m("tangguh_cache_misses_total", type="metered") == 2
    assert m("tangguh_cache_rebuilds_total", type="metered") == 2
    assert m("tangguh_cache_stale_served_total", type="metered") == 2
    assert not any("not_a_metric" in name for name, _ in http)
    # histograms
    assert m("tangguh_job_duration_seconds_count", type="noop") == 3
    assert m("tangguh_job_time_to_complete_seconds_count", type="noop") == 3
    assert m("tangguh_job_time_to_complete_seconds_count", type="poison") == 0
    assert value(http, "tangguh_broker_round_trip_seconds_count", op="claim") > 0
    # Acks due together go in one round trip (ack_many): at least one, at most one per job.
    acks = 3 + 1 + 1 + 1 + 1  # noop, suicide, hold, metered, effect_once
    assert 0 < value(http, "tangguh_broker_round_trip_seconds_count", op="ack") <= acks
    assert 0 < value(http, "tangguh_broker_round_trip_seconds_count", op="dead") <= 5
    assert value(http, "tangguh_broker_errors_total", source="main") == 0
    assert value(http, "tangguh_lease_extensions_total") > 0
    # queue gauges from the broker sample, which the heartbeat thread takes: never the main loop,
    # whose stats call counted every dead letter kept (1.5 s at 3 million) while it answered nothing
    assert value(http, "tangguh_broker_round_trip_seconds_count", op="stats") == 0
    assert m("tangguh_queue_dead_jobs") == 5
    assert m("tangguh_queue_scheduled_jobs") == 1
    assert m("tangguh_queue_ready_jobs") == 0 and m("tangguh_queue_in_flight_jobs") == 0
    # the master's own state
    assert value(http, "tangguh_broker_up") == 1
    assert value(http, "tangguh_workers", state="idle") == 2
    assert value(http, "tangguh_generation") == 2
    assert value(http, "tangguh_heartbeat_interval_seconds") == 0.5


def test_http_endpoint_answers_errors_and_stays_up(ran):
    d, _ = ran
    host, port = d.status()["metrics_listen"].rsplit(":", 1)
    for raw, expected in ((b"POST /metrics HTTP/1.0\r\n\r\n", b"HTTP/1.0 405"),
                              (b"GET /nope HTTP/1.0\r\n\r\n", b"HTTP/1.0 404"),
                              (b"garbage\r\n\r\n", b"HTTP/1.0 400"),
                              (b"\r\n\r\nGET /metrics HTTP/1.0\r\n\r\n", b"HTTP/1.0 200"),  # empty lines first
                              (b"GET /metrics HTTP/1.0\r\nX: " + b"a" * 20000, b"HTTP/1.0 431"),
                              # whole, and over the 8 KiB limit: refused though one read holds it all
                              (b"GET /metrics HTTP/1.0\r\nX: " + b"a" * 9000 + b"\r\n\r\n", b"HTTP/1.0 431")):
        with socket.create_connection((host, int(port)), timeout=10) as s:
            try:
                s.sendall(raw)
            except OSError:
                pass  # it may answer and close before the oversize request is all sent
            assert s.recv(100).startswith(expected), raw[:20]
    assert http_get(f"http://{host}:{port}/metrics")[0] == 200



def test_log_follows_one_job_from_claim_to_ack(ran):
    d, ids = ran
    job_id = ids["noop"][1]
    mine = d.records(job_id=job_id)
    assert [r["event"] for r in mine] == ["claim", "start", "done", "acked"]
    for r in mine:
        assert (r["type"], r["queue"], r["attempt"]) == ("noop", "default", 1)
        assert (r["resource_id"], r["idempotency_key"]) == ("r1", "k1")
        assert r["trace_id"] == d.job(job_id).trace_id

    retried = " ".join(r["event"] for r in d.records(job_id=ids["suicide"]))
    # prefetch = "auto" hands back at once a job of a type it has not measured when no child
    # is free ("released", then claimed again): no attempt, so no part of the attempt trail.
    retried = retried.replace("claim released ", "").split()
    assert retried == ["claim", "start", "crash", "retry", "retry_stored", "claim", "start", "done", "acked"]


def test_supervisor_events_are_one_record_each_with_slot_and_pid(ran):
    d, ids = ran
    recs = d.records()
    crash = [r for r in recs if r.get("event") == "crash"]
    assert {r["job_id"] for r in crash} == {ids["suicide"], ids["once"]} and len(crash) == 2
    assert all(r["signal"] == signal.SIGKILL for r in crash)
    kill = [r for r in recs if r.get("event") == "timeout_kill"]
    assert len(kill) == 1 and kill[0]["job_id"] == ids["spin"]
    lost = [r for r in recs if r.get("event") == "lease_lost"]
    assert len(lost) == 1 and lost[0]["job_id"] == ids["hold"]
    for r in crash + kill + lost:
        assert isinstance(r["slot"], int) and isinstance(r["pid"], int)
    spawns = [r for r in recs if r.get("event") == "spawn"]
    # 2 at start, 4 replacements, 2 for the reload's new generation
    assert len(spawns) == 8 and all(isinstance(r["slot"], int) and r["pid"] > 0 for r in spawns)
    assert len({r["pid"] for r in spawns}) == 8
    assert [r["event"] for r in recs if r.get("event", "").startswith("reload")] == ["reload", "reload_failed"]


QUEUE_GAUGES = ("tangguh_queue_ready_jobs", "tangguh_queue_scheduled_jobs", "tangguh_queue_in_flight_jobs",
                "tangguh_queue_waiting_jobs", "tangguh_queue_dead_jobs", "tangguh_queue_oldest_ready_age_seconds",
                "tangguh_queue_paused")


def queue_series(d, queue):
    """{gauge name: value} of ``queue``'s series in the daemon's metrics."""
    scrape = samples(request(d.socket, {"cmd": "metrics"})["text"])
    return {name: v for (name, labels), v in scrape.items() if name in QUEUE_GAUGES and labels == (("queue", queue),)}


def test_a_queue_a_reload_stops_serving_loses_its_gauges(tmp_path):
    # They kept their last sample for good: a dashboard showed a depth that was not there.
    d = Daemon(tmp_path, broker={"queues": ["default", "legacy"]})
    try:
        d.start()
        d.enqueue("noop", {}, queue="legacy", delay=3600)
        d.enqueue("no_such_type", {}, queue="legacy", max_attempts=1)
        wait_for(lambda: queue_series(d, "legacy").get("tangguh_queue_dead_jobs") == 1, timeout=30,
                 message="legacy's dead job sampled")
        assert set(queue_series(d, "legacy")) == set(QUEUE_GAUGES)
        assert queue_series(d, "legacy")["tangguh_queue_scheduled_jobs"] == 1
        d.config["broker"]["queues"] = ["default"]
        d.write_config()
        d.signal(signal.SIGHUP)
        wait_for(lambda: d.status()["generation"] == 2 and d.ready(), message="the reload")
        wait_for(lambda: not queue_series(d, "legacy"), timeout=30, message="legacy's series gone")
        assert set(queue_series(d, "default")) == set(QUEUE_GAUGES)  # the served queue keeps all of its own
        assert d.broker.stats(["legacy"])["legacy"].dead == 1  # the jobs are there, only no longer served
        # Served again: its paused flag is sampled with the rest (it was set only when the set
        # of paused queues changed, so a queue a reload brought back had none).
        d.config["broker"]["queues"] = ["default", "legacy"]
        d.write_config()
        d.signal(signal.SIGHUP)
        wait_for(lambda: d.status()["generation"] == 3 and d.ready(), message="the second reload")
        wait_for(lambda: set(queue_series(d, "legacy")) == set(QUEUE_GAUGES), timeout=30,
                 message="every gauge of legacy back, its paused flag too")
        assert queue_series(d, "legacy")["tangguh_queue_paused"] == 0
        d.signal(signal.SIGTERM)
        assert d.wait_exit() == 0
        d.assert_clean()
    finally:
        d.stop()


# -- alert rules and dashboard: every name they use is one the daemon exports ---------------------

OPS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ops")
DOCS = os.path.join(os.path.dirname(OPS), "docs", "operating.md")
PROMQL_WORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "offset",
                "bool", "inf", "nan"}
SCRAPED_BY_PROMETHEUS = {"up"}  # made by the scraper, not the daemon


def exported_names(text):
    """Every series name an exposition defines, with the suffixes Prometheus stores."""
    names = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        names.update(s.name for s in family.samples)
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "summary": ("_count", "_sum")}
        names.update(family.name + s for s in suffixes.get(family.type, ()))
    return names


def metric_names(expr):
    """The metric names a PromQL expression reads (no parser needed for the subset the files use)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range selectors, $__rate_interval
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", expr):
        if m.start() > 0 and (expr[m.start() - 1].isdigit() or expr[m.start() - 1] in ".$"):
            continue  # 1e-9, 5m, a $variable
        if expr[m.end():].lstrip().startswith("(") or m.group().lower() in PROMQL_WORDS:
            continue  # a function or a keyword
        names.add(m.group())
    return names


def test_metric_names_reads_what_an_expression_reads():
    expr = ('sum by (queue, type) (rate(tangguh_a_total{queue=~"$queue", x="rate(y)"}[5m] offset 5m)) '
            '/ (histogram_quantile(0.9, tangguh_b_bucket) + 1e-9) > 3 * tangguh_c unless on (instance) up')
    assert metric_names(expr) == {"tangguh_a_total", "tangguh_b_bucket", "tangguh_c", "up"}


def anchors(markdown):
    """GitHub's heading anchors of a Markdown file."""
    out = set()
    for line in markdown.splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^a-z0-9 _-]", "", title).replace(" ", "-"))
    return out


def test_alert_rules_use_exported_metrics_and_have_a_runbook(ran):
    d, _ = ran
    exported = exported_names(tangguh("metrics", "-c", d.config_path).stdout) | SCRAPED_BY_PROMETHEUS
    with open(os.path.join(OPS, "alerts.yml")) as f:
        rules = [r for g in yaml.safe_load(f)["groups"] for r in g["rules"]]
    assert {r["alert"] for r in rules} >= {
        "TangguhOldestJobOverSLA", "TangguhRetryRateRising", "TangguhDeadLetterGrowing",
        "TangguhVisibilityTimeoutExpiries", "TangguhLockContentionHigh", "TangguhCacheMissRateJumping",
        "TangguhChildrenCrashLooping", "TangguhNoHeartbeat"}
    with open(DOCS) as f:
        doc_anchors = anchors(f.read())
    for rule in rules:
        used = metric_names(rule["expr"])
        assert used and used <= exported, f"{rule['alert']} reads {sorted(used - exported)}, not exported"
        assert rule["labels"]["severity"] in ("page", "warning")
        assert {"summary", "description", "runbook_url"} <= set(rule["annotations"])
        anchor = rule["annotations"]["runbook_url"].split("#", 1)[1]
        assert anchor in doc_anchors, f"{rule['alert']}: no heading #{anchor} in docs/operating.md"


def test_promtool_checks_the_rules_and_runs_their_unit_tests(ran):
    if shutil.which("promtool") is None:
        message = "promtool not installed (Debian package prometheus; .ci/run extracts it)"
        if os.environ.get("TANGGUH_REQUIRE_SERVICES") == "1":
            pytest.fail(message)
        pytest.skip(message)
    d, _ = ran
    scrape = tangguh("metrics", "-c", d.config_path).stdout
    lint = subprocess.run(["promtool", "check", "metrics"], input=scrape, capture_output=True, text=True, timeout=60)
    assert lint.returncode == 0 and not lint.stdout.strip(), lint.stdout + lint.stderr  # naming conventions
    check = subprocess.run(["promtool", "check", "rules", "alerts.yml"], cwd=OPS, capture_output=True, text=True,
                           timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    unit = subprocess.run(["promtool", "test", "rules", "alerts.test.yml"], cwd=OPS, capture_output=True, text=True,
                          timeout=120)
    assert unit.returncode == 0 and "SUCCESS" in unit.stdout, unit.stdout + unit.stderr


def test_dashboard_panels_read_exported_metrics(ran):
    d, _ = ran
    exported = exported_names(tangguh("metrics", "-c", d.config_path).stdout)
    with open(os.path.join(OPS, "grafana-dashboard.json")) as f:
        dash = json.load(f)
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    assert dash["uid"] and len(panels) >= 12
    seen = set()
    for p in panels:
        assert p["title"] and p["description"] and p["targets"], p.get("title")
        for target in p["targets"]:
            used = metric_names(target["expr"])
            assert used and used <= exported, f"panel {p['title']!r} reads {sorted(used - exported)}"
            seen |= used
    # The dashboard shows every family the daemon exports (process_* aside).
    families = {n for n in exported if n.startswith("tangguh_")}
    shown = {re.sub(r"_(bucket|count|sum|total)$", "", n) for n in seen}
    missing = {n for n in families if re.sub(r"_(bucket|count|sum|total|created)$", "", n) not in shown}
    assert not missing, f"not on the dashboard: {sorted(missing)}"


# -- the pieces, without a daemon --------------------------------------------------------------

def test_queue_sample_sets_the_gauges(tmp_path):
    broker = open_broker(f"sqlite:///{tmp_path}/b.db")
    broker.migrate()
    broker.enqueue(NewJob("a", {}))
    broker.enqueue(NewJob("a", {}))
    broker.enqueue(NewJob("a", {}, delay=60))
    broker.enqueue(NewJob("a", {}, queue="other"))
    [job] = broker.claim(["other"], 1, 30, "me")
    broker.dead(job.lease, "permanent", {})
    broker.enqueue(NewJob("a", {}, queue="other"))
    [job] = broker.claim(["other"], 1, 30, "me")
    broker.enqueue(NewJob("callback", {}, queue="other", depends_on=[job.id]))  # waits on the running one
    wait_for(lambda: broker.stats(["default"])["default"].oldest_ready_age > 0, message="the ready jobs to age")
    m = Metrics()
    m.sample_queues(broker.stats(["default", "other"]))
    s = samples(m.render())
    assert value(s, "tangguh_queue_ready_jobs", queue="default") == 2
    assert value(s, "tangguh_queue_scheduled_jobs", queue="default") == 1
    assert value(s, "tangguh_queue_oldest_ready_age_seconds", queue="default") > 0
    assert value(s, "tangguh_queue_dead_jobs", queue="other") == 1
    assert value(s, "tangguh_queue_in_flight_jobs", queue="other") == 1
    assert value(s, "tangguh_queue_waiting_jobs", queue="other") == 1
    assert value(s, "tangguh_queue_waiting_jobs", queue="default") == 0
    assert value(s, "tangguh_queue_oldest_ready_age_seconds", queue="other") == 0
    assert value(s, "tangguh_queue_sample_timestamp_seconds") > 0
    broker.close()


def test_a_slow_queue_sample_comes_less_often_and_a_change_of_queues_at_once(tmp_path):
    """The heartbeat's queue sample costs the broker the count of every job kept in each state:
    one that took 2 s waits 2 / SAMPLE_SHARE s for the next, not SAMPLE_SECONDS."""
    url = f"sqlite:///{tmp_path}/broker.db"
    with open_broker(url) as broker:
        broker.migrate()
    taken = []
    beat = heartbeat.Heartbeat(url, 30, 1, None, ["default"], on_sample=taken.append)
    readings = iter([1000.0, 1002.0])  # the clock before and after the call: it took 2 s
    beat.sample(clock=lambda: next(readings))
    assert len(taken) == 1 and set(beat.queue_stats) == {"default"}
    assert beat.next_sample_at == 1000.0 + 2.0 / heartbeat.SAMPLE_SHARE
    beat.sample(clock=lambda: 1000.0 + metrics.SAMPLE_SECONDS + 1)  # past SAMPLE_SECONDS, not yet due
    assert len(taken) == 1
    beat.queues = ["default", "other"]  # a reload serves other queues: their gauges follow at once
    readings = iter([1010.0, 1010.01])
    beat.sample(clock=lambda: next(readings))
    assert len(taken) == 2 and set(beat.queue_stats) == {"default", "other"}
    assert beat.next_sample_at == 1010.0 + metrics.SAMPLE_SECONDS
    beat.close()


def test_child_deltas_ignore_unknown_keys_and_bad_values():
    m = Metrics()
    job = Job(id="j", type="t", queue="q", payload={})
    m.child_deltas(job, {"cache_hit": 2, "cache_miss": "x", "lock_failed": True, "lock_wait_seconds": -1,
                         "duplicates_suppressed": float("nan"), "bogus": 5})
    m.child_deltas(job, None)
    m.child_deltas(job, ["cache_hit"])
    s = samples(m.render())
    assert value(s, "tangguh_cache_hits_total", queue="q", type="t") == 2
    # a cache user gets every cache series (ratios need both sides), a lock user every lock series
    assert ("tangguh_cache_misses_total", (("queue", "q"), ("type", "t"))) in s
    assert ("tangguh_lock_acquired_total", (("queue", "q"), ("type", "t"))) in s
    for name in ("tangguh_cache_misses_total", "tangguh_lock_failed_total", "tangguh_lock_wait_seconds_total",
                 "tangguh_duplicates_suppressed_total"):
        assert value(s, name, queue="q", type="t") == 0


def test_a_jobs_series_follow_the_served_types_across_a_reload_and_what_waits_for_a_render_is_bounded():
    """Status holds a job's counts back until the next render: a type no handler served took the
    "unknown" label and must take its own once a reload serves it, counts made before the reload
    keeping theirs; a producer's endless type names must grow neither what waits nor the
    histograms' series, and no count may be lost."""
    from types import SimpleNamespace

    from supervisor.master.status import Status

    arbiter = SimpleNamespace(handlers={"served": object()})
    m = Metrics()
    m.arbiter = arbiter  # what type_label reads (not the live gauges' collector)
    st = Status(None, m, None)
    job = Job(id="j", type="later", queue="q", payload={})
    st.count("succeeded", job=job)
    st.attempt(job, {"duration": 0.5, "metrics": {}})
    arbiter.handlers = {"served": object(), "later": object()}  # a reload: a new generation's handlers
    st.count("succeeded", job=job, n=2)
    st.attempt(job, {"duration": 0.5, "metrics": {}})
    st.count("failed", "exception", job=job)
    s = samples(m.render())
    assert value(s, "tangguh_jobs_succeeded_total", queue="q", type="unknown") == 1
    assert value(s, "tangguh_jobs_succeeded_total", queue="q", type="later") == 2
    assert value(s, "tangguh_job_duration_seconds_count", queue="q", type="unknown") == 1
    assert value(s, "tangguh_job_duration_seconds_count", queue="q", type="later") == 1
    assert value(s, "tangguh_jobs_failed_total", queue="q", type="later", reason="exception") == 1
    assert st.counters["succeeded"] == 3 and st.counters["failed"] == 1
    assert not st.tally  # the render took every count
    many = 5000
    for i in range(many):
        typed = Job(id=f"j{i}", type=f"type-{i}", queue="q", payload={})
        st.count("claimed", job=typed)
        st.attempt(typed, {"duration": 0.001})
    assert len(st.tally) == 1  # every unknown type is one label
    assert set(m.duration.children) == {("q", "unknown"), ("q", "later")}
    s = samples(m.render())
    assert value(s, "tangguh_jobs_claimed_total", queue="q", type="unknown") == many
    assert value(s, "tangguh_job_duration_seconds_count", queue="q", type="unknown") == 1 + many
    assert st.counters["succeeded"] == 3  # "claimed" is a metric only


def test_a_job_histogram_writes_what_prometheus_clients_histogram_writes():
    """The job histograms keep plain counts (metrics.JobHistogram); their exposition must be the
    text a prometheus_client Histogram fed the same values writes, a value on a bound included."""
    import random

    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from supervisor.metrics import COMPLETE_BUCKETS, DURATION_BUCKETS, JobHistogram

    for buckets in (DURATION_BUCKETS, COMPLETE_BUCKETS):
        theirs, ours = CollectorRegistry(auto_describe=True), CollectorRegistry(auto_describe=True)
        reference = Histogram("h_seconds", "doc", ("queue", "type"), buckets=buckets, registry=theirs)
        kept = JobHistogram("h_seconds", "doc", buckets, ours)
        rng = random.Random(7)
        values = [*buckets, *(b * 1.0000001 for b in buckets), 0.0, 1e-9, buckets[-1] * 10,
                  *(rng.expovariate(1 / buckets[len(buckets) // 2]) for _ in range(2000))]
        for i, v in enumerate(values):
            labels = ("q", "a" if i % 3 else "b")
            reference.labels(*labels).observe(v)
            kept.labels(*labels).observe(v)
        reference.labels("q", "never")  # a series with no value yet
        kept.labels("q", "never")
        assert generate_latest(ours).decode() == generate_latest(theirs).decode()


def test_exporter_times_out_a_silent_client():
    sel = selectors.DefaultSelector()
    exporter = HttpExporter("127.0.0.1:0", sel, lambda: "x 1\n", client_timeout=0.2)
    host, port = exporter.address.rsplit(":", 1)
    client = socket.create_connection((host, int(port)), timeout=10)
    client.setblocking(False)
    got = bytearray()

    def answered():
        for key, mask in sel.select(0.05):
            key.data(mask)
        exporter.expire_clients()
        try:
            got.extend(client.recv(4096))
        except BlockingIOError:
            pass
        return got.startswith(b"HTTP/1.0 408") and not exporter.clients

    wait_for(answered, message="the silent client to get 408 and be dropped")
    client.close()
    exporter.close()
    sel.close()


@pytest.mark.parametrize("split", [0, 1, 2, 3])
def test_a_request_at_the_exporters_limit_is_answered_however_its_terminator_is_split(split):
    # The request ends exactly at the 8 KiB limit; the first ``split`` bytes of its "\r\n\r\n"
    # arrive with it, the rest in a later read. Counting them as request bytes refused it (431).
    sel = selectors.DefaultSelector()
    exporter = HttpExporter("127.0.0.1:0", sel, lambda: "x 1\n")
    host, port = exporter.address.rsplit(":", 1)
    head = b"GET /metrics HTTP/1.0\r\nX: "
    head += b"a" * (exporter.max_request - len(head))
    client = socket.create_connection((host, int(port)), timeout=10)
    client.sendall(head + b"\r\n\r\n"[:split])
    wait_for(lambda: [key.data(mask) for key, mask in sel.select(0.05)] and exporter.clients
             and len(next(iter(exporter.clients.values())).inbox) == len(head) + split,
             message="the first part read")
    client.sendall(b"\r\n\r\n"[split:])
    client.setblocking(False)
    got = bytearray()

    def answered():
        for key, mask in sel.select(0.05):
            key.data(mask)
        try:
            got.extend(client.recv(4096))
        except BlockingIOError:
            pass
        return b"\r\n\r\n" in got
    wait_for(answered, message="the answer")
    assert got.startswith(b"HTTP/1.0 200"), bytes(got[:40])
    client.close()
    exporter.close()
    sel.close()
