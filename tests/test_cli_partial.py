"""Bulk actions that stop partway, closed pipes, and the dead letters a page at a time.

An action on many jobs that stops (the broker goes, stdout is closed) has
already changed what it changed: the operator must see each outcome as it
happens and one line saying how far it got (exit 1, never 2: 2 promises that
nothing was written). Reading commands piped to ``head`` end quietly.
"""
import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from supervisor import cli
from supervisor.cli import bulk, dlq
from supervisor.errors import BrokerError
from supervisor.model import NewJob, error_info

from .test_cli_bulk import outcomes


@pytest.fixture
def cfg(tmp_path, broker_url):
    path = tmp_path / "tangguh.toml"
    path.write_text(textwrap.dedent(f"""
        [broker]
        url = "{broker_url}"
        queues = ["default"]
    """))
    return str(path)


def run(capsys, cfg, *args):
    code = cli.main(["-c", cfg, *args])
    out, err = capsys.readouterr()
    return code, out, err


def process(cfg, *args, **kw):
    return subprocess.Popen([sys.executable, "-m", "supervisor.cli", "-c", cfg, *args], text=True,
                            stderr=subprocess.PIPE, **kw)


def make_dead(broker, n, key=None):
    ids = []
    for i in range(n):
        ids.append(broker.enqueue(NewJob("report", {"i": i, "pad": "x" * 100},
                                         idempotency_key=f"{key}{i}" if key else None)))
    for job in broker.claim(["default"], n, 300, "w"):
        broker.dead(job.lease, "exception", error_info("exception", "KeyError", "missing"))
    return ids


def test_a_bulk_action_the_broker_fails_partway_says_how_far_it_got(capsys, cfg, broker, monkeypatch):
    broker.enqueue_many([NewJob("email", {"i": i}) for i in range(7)])
    monkeypatch.setattr(bulk, "PAGE", 3)
    real, calls = type(broker).cancel, []

    def dies_on_the_third_page(self, ids, by, reason):
        calls.append(ids)
        if len(calls) >= 3:  # and from then on
            raise BrokerError("broker unreachable (test)")
        return real(self, ids, by, reason)

    monkeypatch.setattr(type(broker), "cancel", dies_on_the_third_page)
    code, out, err = run(capsys, cfg, "cancel", "--type", "email", "--json")
    assert code == 1 and err == "tangguh: error: stopped after 6 of 7: broker unreachable (test)\n"
    got, summary = outcomes(out)
    assert list(got.values()) == ["cancelled"] * 6 and summary["stopped"] == "broker unreachable (test)"
    assert broker.count({"state": "cancelled"}).n == 6
    code, out, err = run(capsys, cfg, "cancel", "--type", "email")
    assert code == 1 and err.startswith("tangguh: error: stopped after 0 of 1: ")


def test_a_bulk_cancel_whose_postgres_table_goes_away_prints_what_it_did(tmp_path, postgres_url):
    import psycopg

    from supervisor.backends import open_broker

    schema = postgres_url.rsplit("schema=", 1)[1]
    b = open_broker(postgres_url)
    b.migrate()
    b.enqueue_many([NewJob("email", {"i": i}) for i in range(600)])
    b.close()
    path = tmp_path / "tangguh.toml"
    path.write_text(f'[broker]\nurl = "{postgres_url}"\nqueues = ["default"]\n')
    proc = process(str(path), "cancel", "--type", "email", "--json", "--rate", "100/s", stdout=subprocess.PIPE)
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + 20
    while len(lines) < 20 and time.monotonic() < deadline:  # progress shows while it runs
        time.sleep(0.05)
    assert len(lines) >= 20, "no outcome printed while the action ran"
    with psycopg.connect(postgres_url.split("?")[0], autocommit=True) as db:  # only this test's schema
        db.execute("SET lock_timeout = '10s'")
        db.execute(f'ALTER TABLE "{schema}".jobs RENAME TO jobs_gone')
        proc.wait(timeout=30)
        reader.join(timeout=5)
        db.execute(f'ALTER TABLE "{schema}".jobs_gone RENAME TO jobs')
        cancelled = db.execute(f"SELECT count(*) FROM \"{schema}\".jobs WHERE state = 'cancelled'").fetchone()[0]
    err = proc.stderr.read()
    got = [json.loads(line) for line in lines if '"id"' in line]
    assert proc.returncode == 1 and err.startswith(f"tangguh: error: stopped after {len(got)} of 600: "), err
    assert err.count("\n") == 1 and 20 <= len(got) == cancelled < 600


def test_dlq_replay_reports_a_held_idempotency_key_per_id_and_replays_the_rest(capsys, cfg, broker):
    dead = make_dead(broker, 3, key="k")
    holder = broker.enqueue(NewJob("report", {}, idempotency_key="k1"))
    code, out, err = run(capsys, cfg, "dlq", "replay", "--all")
    assert (code, err) == (0, "")
    assert out.splitlines() == [f"{dead[1]} conflict", "replayed 2 job(s); not replayed: 1 conflict"]
    assert [broker.get(i).state for i in dead] == ["queued", "dead", "queued"]
    broker.discard([holder])
    code, out, _ = run(capsys, cfg, "dlq", "replay", dead[1], "--json")
    assert code == 0 and outcomes(out) == ({dead[1]: "replayed"}, {"verb": "dlq replay", "count": 1,
                                                                   "outcomes": {"replayed": 1}, "stopped": None})


def test_dlq_all_and_list_all_go_page_by_page(capsys, cfg, broker, monkeypatch):
    monkeypatch.setattr(bulk, "PAGE", 2)
    monkeypatch.setattr(dlq, "PAGE", 2)
    real_list, real_search, limits = type(broker).dlq_list, type(broker).search, []

    def bounded_list(self, type=None, limit=100):
        assert limit is not None and limit <= 1000, "every dead job loaded at once"
        return real_list(self, type, limit)

    def search(self, f, cursor=None, limit=50, order="newest"):
        limits.append(limit)
        return real_search(self, f, cursor, limit, order)

    monkeypatch.setattr(type(broker), "dlq_list", bounded_list)
    monkeypatch.setattr(type(broker), "search", search)
    dead = make_dead(broker, 5)
    code, out, _ = run(capsys, cfg, "dlq", "list", "--limit", "0", "--json")
    assert code == 0 and sorted(j["id"] for j in json.loads(out)) == sorted(dead)
    code, out, _ = run(capsys, cfg, "dlq", "list", "--limit", "0")
    assert code == 0 and out.count("ID ") == 1 and all(i in out for i in dead)
    assert set(limits) == {2} and len(limits) >= 6
    code, out, _ = run(capsys, cfg, "dlq", "replay", "--all")
    assert (code, out) == (0, "replayed 5 job(s)\n") and broker.count({"state": "dead"}).n == 0
    for job in broker.claim(["default"], 5, 300, "w"):
        broker.dead(job.lease, "exception", error_info("exception", "KeyError", "again"))
    code, out, _ = run(capsys, cfg, "dlq", "purge", "--all", "--yes", "--json")
    assert code == 0 and outcomes(out)[1]["outcomes"] == {"purged": 5} and broker.count({}).n == 0


def test_dry_run_json_is_json(capsys, cfg, broker):
    broker.enqueue_many([NewJob("email", {"i": i}) for i in range(3)])
    code, out, _ = run(capsys, cfg, "cancel", "--type", "email", "--dry-run", "--json")
    assert code == 0 and json.loads(out) == {"verb": "cancel", "count": 3, "exact": True, "dry_run": True}
    code, out, _ = run(capsys, cfg, "discard", "job_a", "job_a", "job_b", "--dry-run", "--json")
    assert json.loads(out) == {"verb": "discard", "count": 0, "exact": True, "dry_run": True, "unknown": 2}


@pytest.mark.parametrize("broker_url", ["sqlite"], indirect=True)
def test_a_closed_stdout_stops_a_bulk_action_and_ends_a_listing_quietly(cfg, broker):
    make_dead(broker, 3)
    broker.enqueue_many([NewJob("email", {"i": i}) for i in range(1200)])

    def with_closed_stdout(*args):
        read, write = os.pipe()
        os.close(read)
        proc = process(cfg, *args, stdout=write)
        os.close(write)
        err = proc.stderr.read()
        return proc.wait(timeout=60), err

    assert with_closed_stdout("cancel", "--type", "email") == (
        1, "tangguh: error: stopped after 500 of 1200: stdout closed\n")
    assert broker.count({"state": "cancelled"}).n == 500
    for args in (["jobs"], ["dlq", "list"], ["dlq", "list", "--limit", "0", "--json"], ["stats"]):
        assert with_closed_stdout(*args) == (141, ""), args


@pytest.mark.parametrize("broker_url", ["sqlite"], indirect=True)
def test_a_stream_closed_before_the_start_is_written_to_nowhere(cfg, broker):
    """`tangguh cancel ID >&-` cancelled the job, then failed with a traceback (Python makes a closed
    stdout None); with `2>&-` the error line went to stdout, where `id=$(...)` would take it."""
    job_id = broker.enqueue(NewJob("email", {}))

    def closed(fd, *args):
        proc = subprocess.run([sys.executable, "-m", "supervisor.cli", "-c", cfg, *args], capture_output=True,
                              text=True, preexec_fn=lambda: os.close(fd), timeout=60)
        return proc.returncode, proc.stdout, proc.stderr

    assert closed(1, "cancel", job_id) == (0, "", "")
    assert broker.get(job_id).state == "cancelled"
    assert closed(1, "jobs", "--json") == (0, "", "")
    assert closed(2, "job", "job_nope") == (1, "", "")


@pytest.mark.parametrize("broker_url", ["sqlite"], indirect=True)
@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_disk_under_stdout_stops_a_json_bulk_action_saying_how_far_it_got(cfg, broker):
    """`cancel --json > file` on a full disk: the JSON summary after the failed write failed too, and
    that second error came out alone ("No space left on device"), not how far the action got."""
    broker.enqueue_many([NewJob("email", {"i": i}) for i in range(3)])
    for extra in ([], ["--json"]):
        with open("/dev/full", "w") as full:
            proc = process(cfg, "cancel", "--type", "email", *extra, stdout=full)
            err = proc.stderr.read()
        assert (proc.wait(timeout=60), err) == (
            1, "tangguh: error: stopped after 3 of 3: [Errno 28] No space left on device\n"), extra
        broker.requeue([job.id for job in broker.search({"state": "cancelled"}).jobs])


@pytest.mark.parametrize("broker_url", ["sqlite"], indirect=True)
@pytest.mark.parametrize("args,message", [
    (["dlq", "list", "--limit", str(10**22)], "--limit must be at most 1000"),
    (["status", "--watch", "inf", "--socket", "/nonexistent.sock"], "--watch"),
    (["dlq", "replay", "--all", "--rate", "inf"], "--rate must be a number of replays per second"),
    (["cancel", "--state", "", "--type", "email"], "--state"),
    (["jobs", "\x1b[31m" + "t" * 100_000], "characters cut"),
])
def test_out_of_range_and_hostile_arguments_are_one_short_line(capsys, cfg, broker, args, message):
    code, out, err = run(capsys, cfg, *args)
    assert code == 2 and out == "" and message in err and err.count("\n") == 1, err[:300]
    assert "\x1b" not in err and len(err) < 2000
