"""A job record damaged behind the producer API's back never ends the master nor stops its queue.

A field of a stored job can be set by hand (an UPDATE in sqlite3, an HSET in redis-cli, an
older version's data) to a value no enqueue would store. Such a job used to end the master
at the claim (a history entry that is no object, a timeout that is text), or to fail every
claim after it as "broker down" (Redis: a number stored as other text; SQLite: a priority as
text, sorted inside the claim's transaction), and every restart met the same job again. Now a
job whose damaged field the supervisor needs is dead-lettered at claim (``bad_payload``, the
field named), one whose damaged field it can do without runs, and the jobs around it run.
"""
import pytest

from .daemon import Daemon, tangguh

GOOD = 3


def damage(broker, job_id, field, text):
    """Store ``text`` in ``field`` of a job, behind the producer API's back."""
    kind = type(broker).__name__
    if kind == "SQLiteBroker":
        broker.db.execute(f"UPDATE jobs SET {field} = ? WHERE id = ?", (text, job_id))
    elif kind == "RedisBroker":
        key = f"{broker.prefix}:{{default}}:j:{job_id}"
        assert broker.r.exists(key)
        broker.r.hset(key, field, text)
    else:  # PostgreSQL's columns are typed: only a JSON one takes any text that decodes
        assert broker._execute(f"UPDATE {broker._jobs} SET {field} = %s::json WHERE id = %s",
                               (text, job_id)).rowcount == 1


def run_with_damage(tmp_path, broker_url, field, text, delay=0):
    """Jobs stored (one of them damaged, due after ``delay``) before the daemon starts, so that
    the first claims meet the damage; returns (the daemon's last status, the damaged job, the others)."""
    d = Daemon(tmp_path, broker_url)
    try:
        d.broker.migrate()
        bad = d.enqueue("noop", {"n": "bad"}, delay=delay)
        good = [d.enqueue("noop", {"n": i}) for i in range(GOOD)]
        damage(d.broker, bad, field, text)
        d.start()
        others = [d.wait_job(job_id) for job_id in good]
        job = d.wait_job(bad)
        # One job more after them: a claim still works.
        assert d.wait_job(d.enqueue("noop", {"n": "after"})).state == "done"
        status = d.status()
        assert d.proc.poll() is None
        d.assert_clean()
        return status, job, others, d
    finally:
        d.stop()


def test_a_history_holding_no_attempt_objects_does_not_end_the_master(tmp_path, broker_url):
    status, job, others, d = run_with_damage(tmp_path, broker_url, "history", "[1, 2]")
    assert (status["restarts"], status["broker_down"]) == (0, False)
    assert [j.state for j in others] == ["done"] * GOOD
    assert job.state == "done"  # what it ran for is intact; the stored entries stay as they were
    assert job.history[:2] == [1, 2]
    shown = tangguh("job", job.id, "-c", d.config_path)
    assert shown.returncode == 0, shown.stderr
    assert "  not an attempt: 1\n  not an attempt: 2\n" in shown.stdout


def test_a_history_that_is_no_list_is_dead_lettered_or_repaired_by_the_claim(tmp_path, broker_url):
    status, job, others, d = run_with_damage(tmp_path, broker_url, "history", '"not a list"')
    assert (status["restarts"], status["broker_down"]) == (0, False)
    assert [j.state for j in others] == ["done"] * GOOD
    if "postgresql" in broker_url:
        # PostgreSQL's claim appends with ||, which makes the scalar and the new entry an array.
        assert (job.state, job.history[0]) == ("done", "not a list")
    else:
        assert (job.state, job.reason) == ("dead", "bad_payload")
        assert "the stored history is not a JSON array" in job.error["message"]
    # The operator's look at it shows what is stored, not a traceback.
    shown = tangguh("job", job.id, "-c", d.config_path)
    assert shown.returncode == 0, shown.stderr
    if "postgresql" in broker_url:
        assert "  not an attempt: 'not a list'" in shown.stdout
    else:
        assert "history:          not a list: " in shown.stdout  # Redis: with the dead-letter's entry appended


@pytest.mark.parametrize("field, text, state", [
    ("max_attempts", "x", "dead"),  # the verdict compares attempts with it
    ("timeout", "abc", "dead"),  # the hard timeout's deadline adds it
    ("priority", "p", "dead"),  # SQLite sorted a claim's rows by it, in the claim's transaction
    ("queued_at", "x", "done"),  # only a metric reads it: the job runs
])
def test_a_number_stored_as_other_text_neither_ends_the_master_nor_stops_the_queue(tmp_path, request, field,
                                                                                     text, state):
    # A job due later is made ready from its stored priority (Redis: by a script, which stopped
    # at the text half-way and left the job in neither the delayed nor the ready set).
    for kind, delay in [(kind, delay) for kind in ("sqlite", "redis")  # PostgreSQL's typed columns take none
                        for delay in ((0, 0.5) if field == "priority" else (0,))]:
        where = f"{kind}, delay {delay}"
        url = request.getfixturevalue(f"{kind}_url")
        status, job, others, _ = run_with_damage(tmp_path / f"{kind}-{delay}", url, field, text, delay)
        assert (status["restarts"], status["broker_down"]) == (0, False), where
        assert [j.state for j in others] == ["done"] * GOOD, where
        assert job.state == state, where
        if state == "dead":
            assert job.reason == "bad_payload" and f"the stored {field} is not" in job.error["message"], where
