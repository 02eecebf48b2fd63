"""A big group on Redis is changed by scripts of bounded size: Redis answers no other client while one runs.

The chunk sizes are lowered here so that a small group spans several scripts;
the results must be those of one script, and work cut short between two
scripts must be finished by running the operation again.
"""
import pytest

pytest.importorskip("redis")

from supervisor.client import Client  # noqa: E402
from supervisor.workflows import batch_status, cancel_batch  # noqa: E402

MEMBERS = 40
CHUNK = 7


@pytest.fixture
def client(redis_url):
    with Client.from_url(redis_url) as c:
        c.broker.migrate()
        yield c


def cancel_scripts(broker, monkeypatch):
    """The ids of each cancel script the broker sends (a spy on its round trips; Redis runs them): after KEYS, the key prefix, the channel, by and reason."""
    sha = broker.scripts["cancel"].sha
    sent, exchange = [], broker._exchange

    def spy(commands):
        sent.extend(list(c[3 + c[2] + 4:]) for c in commands if c[0] == "EVALSHA" and c[1] == sha)
        return exchange(commands)
    monkeypatch.setattr(broker, "_exchange", spy)
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
