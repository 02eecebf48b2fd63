"""A big group on Redis is changed by scripts of bounded size: Redis answers no other client while one runs.

The chunk sizes are lowered here so that a small group spans several scripts;
the results must be those of one script, and work cut short between two
scripts must be finished by running the operation again.
"""
import pytest

pytest.importorskip("redis")

from supervisor.client import Client  # noqa: E402
from supervisor.model import NewJob, error_info  # noqa: E402
from supervisor.workflows import batch_status, cancel_batch  # noqa: E402

from .util import wait_for  # noqa: E402

MEMBERS = 40
CHUNK = 7


@pytest.fixture
def client(redis_url):
    with Client.from_url(redis_url) as c:
        c.broker.migrate()
        yield c


def cancel_scripts(broker, monkeypatch):
    """The ids of each cancel script the broker sends (a spy on the calls it packs; Redis runs them):
    each call's own arguments are by, reason, then the ids."""
    sent, packed = [], broker._packed

    def spy(name, queue, more_keys, args):
        if name == "cancel":
            sent.append(list(args[2:]))
        return packed(name, queue, more_keys, args)
    monkeypatch.setattr(broker, "_packed", spy)
    return sent


def a_batch(client):
    batch = client.batch([("export", {"i": i}) for i in range(MEMBERS)], on_success=("report", {}),
                         on_complete=("cleanup", {}))
    first = client.broker.claim(["default"], 1, 30, "w")[0]
    client.broker.ack(first.lease, 0)
    return batch


def test_a_big_batch_is_cancelled_by_scripts_of_at_most_a_chunk_with_the_callbacks_first(client, monkeypatch):
    from supervisor.backends.redis import control

    monkeypatch.setattr(control, "CANCEL_SCRIPT_IDS", CHUNK)
    batch = a_batch(client)
    sent = cancel_scripts(client.broker, monkeypatch)
    got = cancel_batch(client, batch, by="ops")
    assert len(got) == MEMBERS + 1 and set(got.values()) == {"cancelled"}
    assert len(sent) == -(-(MEMBERS + 1) // CHUNK) and max(len(ids) for ids in sent) == CHUNK
    assert sent[0][:2] == [batch.on_success, batch.on_complete]
    status = batch_status(client.broker, batch.id)
    assert (status.done, status.cancelled, status.pending, status.callback_state) == (1, MEMBERS - 1, 0, "cancelled")
    assert client.get(batch.on_complete).state == "cancelled"  # no member's end released it
    assert client.broker.claim(["default"], 100, 30, "w") == []


def test_a_batch_cancel_cut_short_after_its_first_script_is_finished_by_cancelling_again(client, monkeypatch):
    from supervisor.backends.redis import control

    monkeypatch.setattr(control, "CANCEL_SCRIPT_IDS", CHUNK)
    batch = a_batch(client)
    record = client.get(batch.id)
    pending = [batch.on_success, batch.on_complete] + [m for m, (state, _) in record.parents.items() if state is None]
    first = client.broker.cancel(pending[:CHUNK], by="ops", reason="batch cancelled")  # what the first script did
    assert set(first.values()) == {"cancelled"}
    assert batch_status(client.broker, batch.id).pending == MEMBERS - 1 - (CHUNK - 2)
    again = cancel_batch(client, batch, by="ops")
    assert again[batch.on_success] == again[batch.on_complete] == "already_cancelled"
    assert sorted(m for m, how in again.items() if how == "cancelled") == sorted(pending[CHUNK:])
    status = batch_status(client.broker, batch.id)
    assert (status.done, status.cancelled, status.pending, status.callback_state) == (1, MEMBERS - 1, 0, "cancelled")
    assert client.get(batch.on_complete).state == "cancelled"
    assert client.broker.claim(["default"], 100, 30, "w") == []


PAGE = 10
BIG = 150  # the callback's parents


@pytest.fixture
def paged(redis_url, monkeypatch):
    """A client whose scripts take at most PAGE edges off a deleted job's parents in one call."""
    from supervisor.backends.redis import scripts

    for name, text in scripts.sources().items():
        if "local UNLINK_PAGE = 1000\n" in text:
            monkeypatch.setitem(scripts.sources(), name, text.replace("local UNLINK_PAGE = 1000\n",
                                                                      f"local UNLINK_PAGE = {PAGE}\n"))
    with Client.from_url(redis_url) as c:
        c.broker.migrate()
        yield c


def edges_left(client, members, child):
    r, queue = client.broker.r, "default"
    return sum(r.hexists(client.broker.keys.job(queue, m), f"k:{child}") for m in members)


INFO = {"host": "h", "pid": 1, "slot": 0, "duration": 0.001}


def end_all(broker, members, dead=()):
    for job in broker.claim(["default"], len(members), 30, "w"):
        assert job.id in members
        if job.id in dead:
            broker.dead(job.lease, "permanent", error_info("permanent", "Permanent", "no"), INFO)
        else:
            broker.ack(job.lease, 0, INFO)


def a_group(broker, on="success"):
    """(member ids, the callback's id, one the test chose: a new job takes it once it is deleted)."""
    members = [NewJob("export", {"i": i}, id=f"job_big_m{i:03d}") for i in range(BIG)]
    # A value past the server's small-encoding limit: its hash is a table, which HSCAN pages.
    pad = "x" * (int(broker.r.config_get("hash-max-listpack-value")["hash-max-listpack-value"]) + 1)
    callback = NewJob("report", {"pad": pad}, id="job_big_cb", depends_on=[(m.id, on) for m in members])
    broker.enqueue_many(members + [callback])
    return [m.id for m in members], callback.id


def lazily_freed(broker):
    return broker.r.info()["lazyfreed_objects"]  # in INFO memory on Redis 7.0, stats later


def freed_in_the_background(broker, before):
    """The deleted hash went through UNLINK: freeing 100,000 fields inline held Redis a fifth of a second."""
    wait_for(lambda: lazily_freed(broker) > before, message="the callback's hash freed in the background")


def a_new_job_of_its_id(broker, child_id):
    own_parent = broker.enqueue(NewJob("parent", {}, id="job_big_own_parent", delay=3600))
    broker.enqueue(NewJob("report", {}, id=child_id, depends_on=[own_parent]))
    return own_parent


def test_discarding_a_callback_of_many_parents_unlinks_a_page_and_its_id_reused_is_never_settled(paged):
    broker = paged.broker
    ids, then = a_group(broker)
    assert edges_left(paged, ids, then) == BIG
    before = lazily_freed(broker)
    assert broker.discard([then]) == {then: "discarded"}
    freed_in_the_background(broker, before)
    # One script took off a page of the edges, not all of them: the rest are dropped when followed.
    assert 0 < edges_left(paged, ids, then) < BIG
    own_parent = a_new_job_of_its_id(broker, then)
    end_all(broker, ids, dead=ids[:BIG // 2])
    child = broker.get(then)
    assert (child.state, child.pending, child.parents) == ("waiting", 1, {own_parent: (None, None)})
    assert edges_left(paged, ids, then) == 0  # each member's end dropped its stale edge


def test_purging_a_callback_of_many_parents_unlinks_a_page_and_a_replay_never_reopens_its_id(paged):
    broker = paged.broker
    ids, then = a_group(broker, on="complete")
    dead = ids[:PAGE * 3]
    end_all(broker, ids, dead=dead)
    end_all(broker, [then], dead=[then])
    before = lazily_freed(broker)
    assert broker.dlq_purge([then]) == 1
    freed_in_the_background(broker, before)
    own_parent = a_new_job_of_its_id(broker, then)
    assert broker.dlq_replay(dead) == dead  # each one's reopen follows its edge to the callback's id
    child = broker.get(then)
    assert (child.state, child.pending, child.parents) == ("waiting", 1, {own_parent: (None, None)})
    assert edges_left(paged, dead, then) == 0


def test_pruning_a_done_callback_of_many_parents_frees_its_hash_in_the_background(paged):
    broker = paged.broker
    ids, then = a_group(broker)
    end_all(broker, ids)
    end_all(broker, [then])
    before = lazily_freed(broker)
    wait_for(lambda: broker.prune(0) >= 0 and broker.get(then) is None, message="the done callback pruned")
    freed_in_the_background(broker, before)
