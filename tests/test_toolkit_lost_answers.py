"""The handler toolkit's Redis calls whose answer was lost after the server ran them.

A stall past the client's ``socket_timeout`` or a connection cut between a
request and its answer (``tests/replycut.py``, a relay in front of a real
Redis): the server has run the script, the child never heard of it. For a lock
that meant a key held by a token nobody knew, to its TTL, and a master that
could not free it with the job; for a cache's fill lease, every reader of the
key waiting ``wait`` and building without storing until the lease expired.
"""
import json

import pytest

from supervisor import protocol, toolkit
from supervisor.master.locks import MasterLocks
from supervisor.toolkit.cache import Cache
from supervisor.toolkit.locks import FENCE, LockBusy, Locks

from .replycut import ReplyCut


@pytest.fixture
def through(redis_url):
    """(the relay, a toolkit client through it with a short socket timeout, its prefix, a client straight to the server)."""
    cut, url = ReplyCut.of(redis_url)
    relayed, prefix = toolkit.open_redis(url, socket_timeout=0.5)
    direct, _ = toolkit.open_redis(redis_url)
    relayed.ping()  # connected: the next request is the one armed
    yield cut, relayed, prefix, direct
    relayed.close()
    direct.close()
    cut.close()


@pytest.mark.services
def test_a_lock_whose_acquire_answer_was_lost_is_taken_by_the_same_token_and_told_to_the_master(through):
    """The script ran (the key held the child's token) and the answer never came: the acquire
    raised TimeoutError (or waited out ``wait`` and raised LockBusy), the lock stayed to its TTL."""
    cut, relayed, prefix, direct = through
    told = []
    locks = Locks(relayed, prefix, notify=told.append)
    key = f"{prefix}lock:export"
    cut.cut_next(key, hold=True)
    # A wait past the socket timeout (0.5 s): with the wait spent, a timeout is raised, not asked again.
    lock = locks.acquire("export", ttl=30, wait=5)
    assert cut.cut.is_set(), cut.describe()
    assert direct.get(key).decode() == lock.token
    assert lock.fence == int(direct.get(key + FENCE))  # the lost run's fence: no second one handed out
    assert {"op": protocol.LOCK, "key": key, "token": lock.token, "ttl": 30.0} in told
    assert lock.release() and not direct.exists(key)
    assert told[-1] == {"op": protocol.UNLOCK, "key": key, "token": lock.token}


@pytest.mark.services
def test_a_lock_taken_by_an_acquire_that_then_failed_is_freed_by_the_master_with_the_job(through, redis_url):
    """The answer lost and the next try refused: the acquire fails, but the master has heard of
    the token the server may hold, and frees the lock when the job ends, not at its TTL."""
    cut, relayed, prefix, direct = through
    told = []
    locks = Locks(relayed, prefix, notify=told.append)
    key = f"{prefix}lock:export"
    cut.cut_next(key, hold=True)
    cut.refuse_next()  # the try again's new connection
    import redis

    with pytest.raises((redis.ConnectionError, redis.TimeoutError)):
        locks.acquire("export", ttl=30, wait=5)  # past the socket timeout: the lost answer is asked again
    assert cut.cut.is_set(), cut.describe()
    token = direct.get(key).decode()
    assert told == [{"op": protocol.LOCK, "key": key, "token": token, "ttl": 30.0}]
    master = MasterLocks(redis_url)
    master.on_message(4242, told[0])
    assert master.release_child(4242) == 1 and master.release_queued() == 1 and not direct.exists(key)


@pytest.mark.services
def test_a_fill_lease_whose_answer_was_lost_is_taken_by_the_same_token_and_told_to_the_master(through):
    """The lease script ran (the lease held the child's token) and the answer never came: the
    reader built without storing, the lease stayed to its TTL unknown to the master, and every
    other reader of the key waited ``wait`` and built without storing too."""
    cut, relayed, prefix, direct = through
    told = []
    cache = Cache(relayed, prefix, notify=told.append)
    lease = f"{prefix}cache-lease:summary"
    cut.cut_next(lease, hold=True)
    assert cache.get_or_build("summary", lambda: {"total": 3}, ttl=60, tags=["invoice"]) == {"total": 3}
    assert cut.cut.is_set(), cut.describe()
    assert json.loads(direct.get(f"{prefix}cache:summary"))["v"] == {"total": 3}  # stored under the lease
    assert not direct.exists(lease)
    token = told[0]["token"]
    assert told == [{"op": protocol.LOCK, "key": lease, "token": token, "ttl": cache.lease_ttl},
                    {"op": protocol.UNLOCK, "key": lease, "token": token}]


@pytest.mark.services
def test_a_fill_lease_taken_by_a_try_that_then_failed_is_freed_by_the_master_with_the_job(through, redis_url):
    """The answer lost and the next try refused: the reader builds for itself (nothing stored),
    but the master has heard of the token the server holds and frees the lease with the job."""
    cut, relayed, prefix, direct = through
    told = []
    cache = Cache(relayed, prefix, notify=told.append)
    lease = f"{prefix}cache-lease:summary"
    cut.cut_next(lease, hold=True)
    cut.refuse_next()  # the try again's new connection
    assert cache.get_or_build("summary", lambda: {"total": 3}, ttl=60) == {"total": 3}
    assert cut.cut.is_set(), cut.describe()
    token = direct.get(lease).decode()
    assert told == [{"op": protocol.LOCK, "key": lease, "token": token, "ttl": cache.lease_ttl}]
    master = MasterLocks(redis_url)
    master.on_message(4242, told[0])
    assert master.release_child(4242) == 1 and master.release_queued() == 1 and not direct.exists(lease)


@pytest.mark.services
def test_a_lost_answer_to_a_second_acquire_of_a_held_name_leaves_the_masters_record_of_the_holder(through, redis_url):
    """The job holds lock ``export``; another acquire of the same name in it (another thread) loses
    its answer: the master hears of that acquire's token before its try again, which the held key
    refuses. Keyed by the lock's key alone, that token replaced the holder's in the master's
    record: the holder's lock was no longer extended with the job (it lapsed under it at its TTL)
    nor freed at once when the child died."""
    cut, relayed, prefix, direct = through
    master = MasterLocks(redis_url)
    locks = Locks(relayed, prefix, notify=lambda msg: master.on_message(4242, msg))
    key = f"{prefix}lock:export"
    held = locks.acquire("export", ttl=30, wait=0)
    cut.cut_next(key, hold=True)
    import redis

    with pytest.raises((LockBusy, redis.ConnectionError, redis.TimeoutError)):
        locks.acquire("export", ttl=30, wait=0)
    assert cut.cut.is_set(), cut.describe()
    assert direct.get(key).decode() == held.token
    direct.pexpire(key, 5000)
    master.extend_all()  # the heartbeat's: the holder's lock gets its TTL back
    assert direct.pttl(key) > 10_000
    assert master.release_child(4242) == 2 and master.release_queued() == 1 and not direct.exists(key)  # the child died: freed at once



@pytest.mark.services
def test_a_refusal_at_connect_is_not_taken_for_a_lost_answer(redis_url):
    """A wrong password is a ``ConnectionError`` to redis-py, but the server ran nothing: the
    acquire was asked again (a second refusal) and the master told of a token no key holds."""
    import redis

    scheme, rest = redis_url.split("://", 1)
    client, prefix = toolkit.open_redis(f"{scheme}://nobody:wrong@{rest}")
    told = []
    try:
        with pytest.raises(redis.AuthenticationError):
            Locks(client, prefix, notify=told.append).acquire("export", ttl=30, wait=0)
    finally:
        client.close()
    assert told == []
