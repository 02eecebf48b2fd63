"""``tangguh jobs``, ``cancel``, ``retry``, ``discard`` and ``Client.search/count/requeue/discard``, on every broker.

The commands run in-process through ``cli.main`` against a real broker of each
kind; the bad-input contract (exit 2, one line, nothing changed) is checked
on a real process too.
"""
import json
import textwrap

import pytest

from supervisor import cli
from supervisor.client import Client
from supervisor.errors import BadInput
from supervisor.model import NewJob, error_info

from .daemon import tangguh

REFUSED = ('the retry refuses any whose on="success" parent lies dead, cancelled or expired (parent_failed)'
           " or whose idempotency key an unfinished job holds (conflict)")


@pytest.fixture
def cfg(tmp_path, broker_url):
    path = tmp_path / "tangguh.toml"
    path.write_text(textwrap.dedent(f"""
        [broker]
        url = "{broker_url}"
        queues = ["default", "mail"]
    """))
    return str(path)


def run(capsys, cfg, *args):
    code = cli.main(["-c", cfg, *args])
    out, err = capsys.readouterr()
    return code, out, err


def outcomes(out):
    """A bulk action's --json output: one {"id", "outcome"} a line, then the summary; ({id: outcome}, summary)."""
    lines = [json.loads(line) for line in out.splitlines()]
    assert "verb" in lines[-1] and all("verb" not in line for line in lines[:-1])
    return {line["id"]: line["outcome"] for line in lines[:-1]}, lines[-1]


def snapshot(broker):
    return sorted((j.id, j.state, j.attempt) for j in broker.search({}, limit=1000).jobs)


@pytest.fixture
def jobs(broker):
    """Six jobs: four queued (two of them order 7), two dead; {name: id}."""
    made = {
        "a": broker.enqueue(NewJob("email", {"order": {"id": 7}, "to": "x"})),
        "b": broker.enqueue(NewJob("email", {"order": {"id": 8}})),
        "c": broker.enqueue(NewJob("sms", {"order": {"id": 7}}, queue="mail")),
        "d": broker.enqueue(NewJob("sms", {"order": {"id": 9}})),
        "dead1": broker.enqueue(NewJob("report", {"n": 1})),
        "dead2": broker.enqueue(NewJob("report", {"n": 2})),
    }
    for job in broker.claim(["default"], 10, 300, "w"):
        if job.type == "report":
            broker.dead(job.lease, "exception", error_info("exception", "KeyError", "missing invoice"))
        else:
            broker.release(job.lease)
    return made


def test_jobs_lists_by_filter_and_pages_with_the_printed_cursor(capsys, cfg, jobs):
    code, out, _ = run(capsys, cfg, "jobs", "--where", "payload.order.id=7")
    assert code == 0
    assert jobs["a"] in out and jobs["c"] in out and jobs["b"] not in out
    code, out, _ = run(capsys, cfg, "jobs", "--state", "dead", "--error", "INVOICE", "--json")
    listed = json.loads(out)
    assert sorted(j["id"] for j in listed["jobs"]) == sorted([jobs["dead1"], jobs["dead2"]])
    seen, cursor = [], None
    while True:
        extra = ["--cursor", cursor] if cursor else []
        code, out, _ = run(capsys, cfg, "jobs", "--limit", "2", "--json", *extra)
        page = json.loads(out)
        assert code == 0 and len(page["jobs"]) <= 2
        seen += [j["id"] for j in page["jobs"]]
        cursor = page["next_cursor"]
        if not cursor:
            break
    assert sorted(seen) == sorted(jobs.values())
    code, out, _ = run(capsys, cfg, "jobs", "--type", "sms", "--queue", "mail", "--since", "1h")
    assert jobs["c"] in out and jobs["d"] not in out
    code, out, _ = run(capsys, cfg, "jobs", "--until", "1h")
    assert code == 0 and out.strip() == "no jobs"


@pytest.mark.parametrize("args,message", [
    (["jobs", "--state", "sleeping"], "unknown state 'sleeping'"),
    (["jobs", "--where", "order.id=7"], "--where expects payload.KEY=VALUE"),
    (["jobs", "--where", "payload.a..b=7"], "payload key 'a..b'"),
    (["jobs", "--cursor", "garbage"], "bad cursor"),
    (["jobs", "--limit", "0"], "limit must be"),
    (["jobs", "--since", "yesterday"], "--since expects a duration"),
    # So many digits that the number is infinite: "queued_after must be a number of epoch seconds, got -inf".
    (["cancel", "--until", "9" * 400 + "d"], "--until expects a duration"),
    (["retry", "--type", "report", "--rate", "fast"], "--rate"),
    # Below one an hour: the pause before the second job overflowed the clock ("stopped after 1").
    (["retry", "--type", "report", "--rate", "0.0000000000001"], "--rate must be at least 1/h"),
    (["discard"], "--all for every job"),
    (["retry", "--state", "dead", "job_1"], "not both"),
    (["cancel", "--state", "bogus", "--dry-run"], "unknown state 'bogus'"),
    # Counts `status`/`queues` show that are no state: the error says what selects them.
    (["jobs", "--state", "in_flight"], "the in_flight count is of state running"),
    (["discard", "--state", "ready"], "the ready count is of the queued and retrying jobs that are due"),
    # The second value replaced the first: the discard took the jobs of order 8 alone, without a word.
    (["discard", "--where", "payload.order.id=7", "--where", "payload.order.id=8"], "payload.order.id given twice"),
])
def test_bad_input_is_one_line_exit_2_and_changes_nothing(capsys, cfg, broker, jobs, args, message):
    before = snapshot(broker)
    code, out, err = run(capsys, cfg, *args)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert snapshot(broker) == before


def test_bad_input_from_a_real_process(cfg, broker, jobs):
    before = snapshot(broker)
    proc = tangguh("-c", cfg, "discard", "--where", "payload.x")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert "--where expects payload.KEY=VALUE" in proc.stderr
    assert snapshot(broker) == before


def test_a_bulk_action_ctrl_c_ends_says_how_far_it_got_in_its_json_too(cfg, broker):
    """Ctrl-C during a paced cancel: what it printed is done, stderr says where it stopped, the
    --json output ends with its summary (there was none), and the status is 130."""
    import signal
    import subprocess
    import sys

    from .util import wait_for

    ids = broker.enqueue_many([NewJob("t", {"i": i}, delay=3600) for i in range(10)])
    proc = subprocess.Popen([sys.executable, "-m", "supervisor.cli", "-c", cfg, "cancel", "--rate", "4/s", "--json",
                             *ids], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = proc.stdout.readline()  # the first job's outcome: it is under way
    assert json.loads(first)["outcome"] == "cancelled", first
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    lines = [json.loads(line) for line in [first, *out.splitlines()]]
    assert proc.returncode == 130 and "stopped after" in err and "interrupted" in err, (proc.returncode, err)
    assert lines[-1]["stopped"] == "interrupted" and lines[-1]["count"] == len(lines) - 1 < 10, lines[-1]
    done = [line["id"] for line in lines[:-1]]
    wait_for(lambda: all(broker.get(i).state == "cancelled" for i in done), message="what it printed is done")


def test_retry_by_filter_requeues_only_what_it_can_with_a_dry_run_first(capsys, cfg, broker, jobs):
    before = snapshot(broker)
    code, out, _ = run(capsys, cfg, "retry", "--type", "report", "--dry-run")
    assert code == 0 and out.strip() == f"would retry 2 job(s), or fewer: {REFUSED}"
    assert snapshot(broker) == before
    code, out, _ = run(capsys, cfg, "retry", "--type", "report", "--rate", "50/s")
    assert code == 0
    assert f"{jobs['dead1']} queued" in out and f"{jobs['dead2']} queued" in out
    assert out.strip().splitlines()[-1] == "retry: 2 queued"
    for name in ("dead1", "dead2"):
        job = broker.get(jobs[name])
        assert (job.state, job.attempt, len(job.history)) == ("queued", 0, 1)
    code, out, _ = run(capsys, cfg, "retry", jobs["a"], jobs["dead1"], "job_nope", "--json")
    got, summary = outcomes(out)
    assert got == {jobs["a"]: "not_finished", jobs["dead1"]: "not_finished", "job_nope": "unknown"}
    assert summary == {"verb": "retry", "count": 3, "outcomes": {"not_finished": 2, "unknown": 1}, "stopped": None}


def test_a_retry_dry_run_says_the_retry_may_refuse_some_of_those_it_counts(capsys, cfg, broker):
    """A dry run counts the jobs in a state a retry acts on. The retry refuses a job whose
    on="success" parent lies dead, cancelled or expired (parent_failed), or whose idempotency key
    an unfinished job holds (conflict): no broker call tells that beforehand (a job's record gives
    its parents' ends, not each edge's on=), so "would retry 1 job(s)" came before "0 queued"."""
    parent = broker.enqueue(NewJob("report", {"n": 1}, max_attempts=1))
    child = broker.enqueue(NewJob("report", {"n": 2}, depends_on=[parent]))
    [job] = broker.claim(["default"], 10, 300, "w")
    broker.dead(job.lease, "exception", error_info("exception", "KeyError", "missing invoice"))
    assert broker.get(child).state == "cancelled"
    code, out, _ = run(capsys, cfg, "retry", "--state", "cancelled", "--dry-run")
    assert code == 0 and out.strip() == f"would retry 1 job(s), or fewer: {REFUSED}"
    code, out, _ = run(capsys, cfg, "retry", child, "--dry-run", "--json")
    assert json.loads(out) == {"verb": "retry", "count": 1, "exact": True, "dry_run": True, "unknown": 0,
                               "may_refuse": ["parent_failed", "conflict"]}
    code, out, _ = run(capsys, cfg, "retry", "--state", "cancelled")
    assert code == 0 and out.strip().splitlines() == [f"{child} parent_failed", "retry: 1 parent_failed"]


def test_discard_by_payload_field_and_by_ids(capsys, cfg, broker, jobs):
    code, out, _ = run(capsys, cfg, "discard", "--where", "payload.order.id=7", "--dry-run")
    assert out.strip() == "would discard 2 job(s)"
    code, out, _ = run(capsys, cfg, "discard", "--where", "payload.order.id=7")
    assert code == 0 and out.strip().splitlines()[-1] == "discard: 2 discarded"
    assert broker.get(jobs["a"]) is None and broker.get(jobs["c"]) is None and broker.get(jobs["b"]) is not None
    running = broker.claim(["default"], 1, 300, "w")[0].id
    code, out, _ = run(capsys, cfg, "discard", running, jobs["d"], "--json")
    assert outcomes(out)[0] == {running: "running", jobs["d"]: "discarded"}


def test_discard_all_needs_all(capsys, cfg, broker, jobs):
    code, out, _ = run(capsys, cfg, "discard", "--all")
    assert code == 0 and out.strip().splitlines()[-1] == "discard: 6 discarded"
    assert broker.count({}).n == 0


def test_discard_by_filter_leaves_running_jobs_out_of_its_count_and_its_work(capsys, cfg, broker, jobs):
    """Discard refuses a running job: a dry run by filter counted it all the same ("would discard
    6", then "5 discarded, 1 running"). Without --state it now selects every state but running."""
    running = broker.claim(["default"], 1, 300, "w")[0].id
    code, out, _ = run(capsys, cfg, "discard", "--all", "--dry-run")
    assert code == 0 and out.strip() == "would discard 5 job(s)"
    code, out, _ = run(capsys, cfg, "discard", "--all")
    assert code == 0 and out.strip().splitlines()[-1] == "discard: 5 discarded"
    assert broker.get(running).state == "running" and broker.count({}).n == 1


def test_cancel_dry_run_counts_the_unfinished_jobs_it_would_cancel(capsys, cfg, broker, jobs):
    before = snapshot(broker)
    code, out, _ = run(capsys, cfg, "cancel", "--all", "--dry-run")
    assert code == 0 and out.strip() == "would cancel 4 job(s)"
    code, out, _ = run(capsys, cfg, "cancel", "--type", "email", "--dry-run")
    assert out.strip() == "would cancel 2 job(s)"
    # Named ids: the ones it would change, not every id given (a dead job, an id of no job).
    unknown = "job_00000000000000000000000000"
    code, out, _ = run(capsys, cfg, "cancel", jobs["a"], jobs["dead1"], unknown, "--dry-run")
    assert code == 1 and out.strip() == "would cancel 1 job(s); 1 id(s) name no job"
    code, out, _ = run(capsys, cfg, "retry", jobs["a"], jobs["dead1"], jobs["dead2"], unknown, "--dry-run", "--json")
    assert json.loads(out) == {"verb": "retry", "count": 2, "exact": True, "dry_run": True, "unknown": 1,
                               "may_refuse": ["parent_failed", "conflict"]}
    code, out, _ = run(capsys, cfg, "discard", jobs["a"], jobs["dead1"], "--dry-run")
    assert out.strip() == "would discard 2 job(s)"
    assert snapshot(broker) == before


def test_a_dry_run_by_state_counts_only_the_jobs_the_action_changes(capsys, cfg, broker, jobs):
    """`--state` names what to look at, not what the action can do: "cancel --state dead --dry-run"
    said "would cancel 2 job(s)" and the cancel then answered "2 already_dead", and a discard dry
    run by a running state counted jobs the discard refuses. By ids it counted only those it changes."""
    running = broker.claim(["default"], 1, 300, "w")[0].id
    code, out, _ = run(capsys, cfg, "cancel", "--state", "dead", "--dry-run")
    assert code == 0 and out.strip() == "would cancel 0 job(s)"
    code, out, _ = run(capsys, cfg, "cancel", "--state", "dead,queued", "--dry-run", "--json")
    assert json.loads(out) == {"verb": "cancel", "count": 3, "exact": True, "dry_run": True}
    code, out, _ = run(capsys, cfg, "discard", "--state", "running", "--dry-run")
    assert code == 0 and out.strip() == "would discard 0 job(s)"
    code, out, _ = run(capsys, cfg, "retry", "--state", "queued,dead", "--dry-run", "--json")
    assert json.loads(out)["count"] == 2
    code, out, _ = run(capsys, cfg, "cancel", "--state", "dead")
    assert code == 0 and out.strip().splitlines()[-1] == "cancel: 2 already_dead"
    assert broker.get(running).state == "running"


def test_the_client_searches_counts_requeues_and_discards(broker_url, broker, jobs):
    with Client.from_url(broker_url) as client:
        page = client.search(type="email", limit=1)
        assert len(page.jobs) == 1 and page.next_cursor
        assert client.search(type="email", limit=1, cursor=page.next_cursor).jobs[0].id != page.jobs[0].id
        assert client.count(payload={"order.id": 7}).n == 2
        assert client.count({"state": ["dead"]}).n == 2
        assert client.requeue(jobs["dead1"]) == {jobs["dead1"]: "queued"}
        assert client.discard([jobs["b"]]) == {jobs["b"]: "discarded"}
        for bad in (lambda: client.search(colour="red"), lambda: client.search(limit=0),
                    lambda: client.search(cursor="x"), lambda: client.search({"type": "a"}, type="b"),
                    lambda: client.discard([None])):
            with pytest.raises(BadInput):
                bad()


def test_cancel_by_filter_prints_each_outcome_and_records_who_and_why(capsys, cfg, broker, jobs):
    claimed = broker.claim(["default"], 3, 300, "w")
    for job in claimed:
        if job.id != jobs["a"]:
            broker.release(job.lease)
    running, other = jobs["a"], jobs["b"]
    code, out, _ = run(capsys, cfg, "cancel", "--type", "email", "--by", "ops", "--reason", "bad batch")
    assert code == 0
    assert f"{running} requested" in out and f"{other} cancelled" in out
    assert out.strip().splitlines()[-1] == "cancel: 1 cancelled, 1 requested"
    job = broker.get(other)
    assert job.state == "cancelled" and job.history[-1]["by"] == "ops" and job.history[-1]["reason"] == "bad batch"
    assert broker.get(running).cancel_request["by"] == "ops"
    code, out, _ = run(capsys, cfg, "cancel", other, jobs["dead1"], "job_nope", "--json")
    assert outcomes(out)[0] == {other: "already_cancelled", jobs["dead1"]: "already_dead", "job_nope": "unknown"}
    code, out, _ = run(capsys, cfg, "retry", "--state", "cancelled")
    assert out.strip().splitlines()[-1] == "retry: 1 queued" and broker.get(other).state == "queued"


def test_state_scheduled_lists_and_cancels_the_jobs_the_scheduled_column_counts(capsys, cfg, broker, jobs):
    """`queue list` and `stats` show a SCHEDULED column; `jobs --state scheduled` said "unknown state"."""
    later = broker.enqueue(NewJob("email", {"n": 1}, delay=3600))
    code, out, _ = run(capsys, cfg, "queue", "list", "--json")
    assert [q["scheduled"] for q in json.loads(out) if q["queue"] == "default"] == [1]
    code, out, err = run(capsys, cfg, "jobs", "--state", "scheduled", "--json")
    assert code == 0 and [j["id"] for j in json.loads(out)["jobs"]] == [later], err
    code, out, _ = run(capsys, cfg, "retry", "--state", "scheduled", "--dry-run")
    assert code == 0 and out.strip().startswith("would retry 0 job(s)")
    code, out, _ = run(capsys, cfg, "cancel", "--state", "scheduled", "--dry-run")
    assert code == 0 and out.strip() == "would cancel 1 job(s)"
    before = {j.id: j.state for j in broker.search({}, limit=1000).jobs}
    code, out, _ = run(capsys, cfg, "cancel", "--state", "scheduled")
    assert code == 0 and out.strip().splitlines() == [f"{later} cancelled", "cancel: 1 cancelled"]
    assert {j.id: j.state for j in broker.search({}, limit=1000).jobs} == dict(before, **{later: "cancelled"})


@pytest.mark.parametrize("verb,known,outcome,state", [("cancel", "a", "cancelled", "cancelled"),
                                                       ("retry", "dead1", "queued", "queued"),
                                                       ("discard", "b", "discarded", None)])
def test_an_id_that_names_no_job_exits_1_after_acting_on_the_known_ones(capsys, cfg, broker, jobs, verb, known,
                                                                         outcome, state):
    """It printed `job_nope unknown` and exited 0: a script could not tell an id was not found."""
    code, out, err = run(capsys, cfg, verb, jobs[known], "job_nope")
    assert code == 1
    assert f"{jobs[known]} {outcome}" in out and "job_nope unknown" in out
    assert err == f"tangguh: error: {verb}: 1 of 2 id(s) name no job: job_nope\n"
    job = broker.get(jobs[known])
    assert (job.state if job else None) == state
    code, out, err = run(capsys, cfg, verb, "job_nope", "--dry-run")
    assert code == 1 and err == f"tangguh: error: {verb}: 1 of 1 id(s) name no job: job_nope\n"
