"""PostgreSQL: a cancel ending many parents of one child writes that child once, in one
statement for a fan-in's members (schema version 14; it was once per member, a row version each)."""
import threading

import psycopg
import pytest

from supervisor.backends import open_broker
from supervisor.client import Client
from supervisor.workflows import batch_status, cancel_batch

from .util import wait_for

pytestmark = pytest.mark.services

N = 300


@pytest.fixture
def client(postgres_url):
    with Client.from_url(postgres_url) as c:
        c.broker.migrate()
        yield c


@pytest.fixture
def writes(client):
    """Each update of a job row (its id) and each statement updating jobs ('statement'), since the last call."""
    s = client.broker._s
    with psycopg.connect(client.broker.conninfo, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {s}.writes (id text NOT NULL)")
        conn.execute(f"CREATE FUNCTION {s}.note_row() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
                     f" INSERT INTO {s}.writes VALUES (NEW.id); RETURN NULL; END $$")
        conn.execute(f"CREATE FUNCTION {s}.note_statement() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
                     f" INSERT INTO {s}.writes VALUES ('statement'); RETURN NULL; END $$")
        conn.execute(f"CREATE TRIGGER note_row AFTER UPDATE ON {s}.jobs FOR EACH ROW EXECUTE FUNCTION {s}.note_row()")
        conn.execute(f"CREATE TRIGGER note_statement AFTER UPDATE ON {s}.jobs FOR EACH STATEMENT"
                     f" EXECUTE FUNCTION {s}.note_statement()")

    def counts():
        with psycopg.connect(client.broker.conninfo, autocommit=True) as conn:
            return dict(conn.execute(f"WITH w AS (DELETE FROM {s}.writes RETURNING id)"
                                     " SELECT id, count(*) FROM w GROUP BY id").fetchall())
    return counts


def test_cancelling_a_fan_ins_members_writes_each_callback_once(client, writes):
    batch = client.batch([("export", {"i": i}) for i in range(N)], on_success=("report", {}),
                         on_complete=("cleanup", {}))
    after = client.enqueue("notify", {}, depends_on=[batch.on_success])  # the cascade goes on past the callback
    first, second = client.broker.claim(["default"], 2, 30, "w")
    client.broker.ack(first.lease, "one")
    client.broker.ack(second.lease, "two")
    members = [m for m in batch.members if m not in (first.id, second.id)]
    writes()
    got = client.cancel(members, by="ops")
    assert set(got.values()) == {"cancelled"} and len(got) == N - 2
    counts = writes()
    # Each callback once: on_success cancelled by the first failed parent, on_complete released by its last.
    assert (counts.get(batch.on_success), counts.get(batch.on_complete)) == (1, 1), counts
    assert {counts.get(m) for m in members} == {1}
    done = client.get(batch.on_complete)
    assert (done.state, done.pending) == ("queued", 0)
    ends = client.get(batch.on_complete).parents
    assert ends[first.id] == ("done", "one") and ends[second.id] == ("done", "two")
    assert {ends[m] for m in members} == {("cancelled", None)} and len(ends) == N
    failed = client.get(batch.on_success)
    assert (failed.state, failed.reason) == ("cancelled", "parent_failed")
    assert (client.get(after).state, client.get(after).reason) == ("cancelled", "parent_failed")
    status = batch_status(client.broker, batch.id)
    assert (status.done, status.cancelled, status.pending) == (2, N - 2, 0)
    assert [job.id for job in client.broker.claim(["default"], 10, 30, "w")] == [batch.on_complete]


def test_cancel_batch_ends_the_members_in_one_statement(client, writes):
    batch = client.batch([("export", {"i": i}) for i in range(N)], on_success=("report", {}),
                         on_complete=("cleanup", {}))
    got = cancel_batch(client, batch, by="ops")
    assert len(got) == N + 2 and set(got.values()) == {"cancelled"}
    counts = writes()
    assert {counts.get(job_id) for job_id in [*batch.members, batch.on_success, batch.on_complete]} == {1}
    assert counts["statement"] == 2  # the cancel's, and the settle's of the callbacks (none left waiting)
    status = batch_status(client.broker, batch.id)
    assert (status.cancelled, status.pending, status.callback_state) == (N, 0, "cancelled")
    assert client.broker.claim(["default"], 10, 30, "w") == []


def test_a_member_acked_while_the_others_are_cancelled_is_counted_once(client, postgres_url):
    batch = client.batch([("export", {"i": i}) for i in range(N)], on_complete=("cleanup", {}))
    (running,) = client.broker.claim(["default"], 1, 30, "w")
    others = [m for m in batch.members if m != running.id]
    acker = open_broker(postgres_url)
    with psycopg.connect(client.broker.conninfo) as holder, \
            psycopg.connect(client.broker.conninfo, autocommit=True) as watcher:
        # The callback's row held: both the cancel and the ack queue up behind it, either may go first.
        holder.execute(f"SELECT 1 FROM {client.broker._s}.jobs WHERE id = %s FOR UPDATE", (batch.on_complete,))
        threads = [threading.Thread(target=client.cancel, args=(others,), kwargs={"by": "ops"}),
                   threading.Thread(target=acker.ack, args=(running.lease, "mine"))]
        for thread in threads:
            thread.start()
        wait_for(lambda: watcher.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                                         " AND position(%s in query) > 0", (client.broker.schema,)).fetchone()[0] >= 2,
                 message="the cancel and the ack to wait on the callback's row")
        holder.rollback()
        for thread in threads:
            thread.join(30)
    acker.close()
    done = client.get(batch.on_complete)
    assert (done.state, done.pending) == ("queued", 0)
    assert done.parents[running.id] == ("done", "mine")
    assert {done.parents[m] for m in others} == {("cancelled", None)}
    assert [job.id for job in client.broker.claim(["default"], 10, 30, "w")] == [batch.on_complete]
