"""The handler toolkit at its edges, against real Redis and databases: names Redis would spell
otherwise than the toolkit, a release a demoted Redis refuses, a reader whose clock is not the
writer's.
"""
import enum

import pytest

from supervisor import toolkit
from supervisor.toolkit.cache import Cache
from supervisor.toolkit.transaction import transaction


@pytest.fixture
def rc(redis_url):
    client, prefix = toolkit.open_redis(redis_url)
    yield client, prefix
    client.close()


class Kind(str, enum.Enum):  # a name a handler may well pass: its f-string is "Kind.INVOICE", its text "invoice:7"
    INVOICE = "invoice:7"


def test_a_cache_name_redis_would_spell_otherwise_is_refused_or_read_as_its_text(rc, tmp_path):
    """The scripts name an entry from the text Redis was sent, Python from its f-string: a tag
    given as one string (``tags="invoice:1"``: a tag per letter), a bytes key or tag, a str enum,
    each stored an entry that invalidating its name or tag never reached: the cache lied for its TTL."""
    client, prefix = rc
    cache = Cache(client, prefix)
    built = []
    for key, tags, said in (("invoice:1:summary", "invoice:1", "tags must be a list"),
                            (b"invoice:1:summary", (), "key must be a non-empty string"),
                            ("invoice:1:summary", [b"invoice:1"], "tag must be a non-empty string"),
                            ("", (), "key must be a non-empty string"),
                            ("invoice:\ud800", (), "lone surrogate")):
        with pytest.raises(ValueError, match=said):
            cache.get_or_build(key, lambda: built.append(1), ttl=60, tags=tags)
        with pytest.raises(ValueError, match=said):
            cache.lease(key, ttl=60, tags=tags)
    assert built == [] and client.keys(f"{prefix}*") == []
    with pytest.raises(ValueError, match="name must be a non-empty string"):
        cache.invalidate("invoice:1", b"invoice:1")
    db = toolkit.Database(f"sqlite:///{tmp_path}/app.db")
    try:
        with pytest.raises(ValueError, match="name must be a non-empty string"):
            with transaction(db) as tx:  # refused in the block, where the job can still fail: not after its commit
                cache.invalidate_after_commit(tx, b"invoice:1")
    finally:
        db.close()

    # A str subclass is its text, in every name: its tag and its key both reach the entry.
    assert cache.get_or_build(Kind.INVOICE, lambda: "old", ttl=60, tags=[Kind.INVOICE]) == "old"
    cache.invalidate("invoice:7")
    assert cache.get_or_build("invoice:7", lambda: "new", ttl=60, tags=["invoice:7"]) == "new"
    cache.invalidate(Kind.INVOICE)
    assert cache.get_or_build(Kind.INVOICE, lambda: "newer", ttl=60) == "newer"
    tags = (t for t in ["invoice:7"])  # read once by the lease, once by the store: a generator gave the store none
    assert cache.get_or_build("invoice:7:list", lambda: "page", ttl=60, tags=tags) == "page"
    cache.invalidate("invoice:7")
    assert not client.exists(f"{prefix}cache:invoice:7:list") and not client.keys(f"{prefix}cache:Kind*")


def test_a_lock_release_a_demoted_redis_refuses_leaves_the_bodys_outcome_alone(tmp_path):
    """A failover demoted the lock's Redis while the block ran (the client's connection still on it,
    as a Sentinel client's is until it breaks): the release's ReadOnlyError replaced the body's own
    exception (a Permanent was retried) and failed a body that had done its work, to be done again."""
    from supervisor.retry import Permanent
    from supervisor.toolkit.locks import Locks

    from .servers import RedisServer

    (tmp_path / "old").mkdir(), (tmp_path / "new").mkdir()
    server, primary = RedisServer(tmp_path / "old").start(), RedisServer(tmp_path / "new").start()
    client = server.client(socket_timeout=5)
    try:
        locks = Locks(client, "p:")
        with pytest.raises(Permanent, match="bad invoice"):
            with locks.acquire("invoice:1", ttl=30):
                client.replicaof("127.0.0.1", primary.port)
                raise Permanent("bad invoice")
        client.replicaof("no", "one")
        with locks.acquire("invoice:2", ttl=30) as lock:
            client.replicaof("127.0.0.1", primary.port)
            done = True
        assert done and not lock.held
    finally:
        client.close()
        server.stop()
        primary.stop()


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_an_advisory_lock_key_that_is_not_text_is_refused_on_both_databases(kind, postgres_url, tmp_path):
    """``advisory_lock(tx, invoice_id)`` with an int: PostgreSQL failed with AttributeError ('int' object
    has no attribute 'encode'), and SQLite took it: a handler tried on SQLite broke on PostgreSQL."""
    from supervisor.toolkit.locks import advisory_lock

    db = toolkit.Database(postgres_url if kind == "postgres" else f"sqlite:///{tmp_path}/app.db")
    try:
        for key in (42, b"invoice:1", "", "invoice:\ud800"):
            with pytest.raises(ValueError, match="advisory lock key"):
                with transaction(db) as tx:
                    advisory_lock(tx, key)
        with transaction(db) as tx:
            advisory_lock(tx, "invoice:1", timeout=0)
    finally:
        db.close()


def _clock_off_by(monkeypatch, seconds):
    """This process's wall clock as another host's would read: ``seconds`` ahead (or behind)."""
    import time

    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + seconds)


def test_an_entrys_freshness_is_judged_by_redis_not_by_the_readers_clock(rc, monkeypatch):
    """An entry carried its end of freshness as the filler's wall-clock time, and each reader
    compared it with its own: a reader ten minutes ahead (another web host, a clock stepped
    forward) took every entry of a key that tolerates no staleness for stale and rebuilt it at
    each read, and a reader behind served a stale entry as fresh, never revalidated."""
    from .util import wait_for

    client, prefix = rc
    metrics = {}
    cache = Cache(client, prefix, metrics)
    assert cache.get_or_build("strict", lambda: "built", ttl=300) == "built"
    assert cache.get_or_build("tolerant", lambda: "old", ttl=0.05, stale_ttl=300) == "old"
    wait_for(lambda: client.pttl(f"{prefix}cache:tolerant") <= 300_000, timeout=5,
             message="the tolerant entry to go stale by Redis's clock")
    with monkeypatch.context() as m:
        _clock_off_by(m, 600)
        assert cache.get_or_build("strict", lambda: "rebuilt", ttl=300) == "built"
    assert metrics == {"cache_miss": 2, "cache_rebuild": 2, "cache_hit": 1}
    with monkeypatch.context() as m:
        _clock_off_by(m, -600)
        assert cache.get_or_build("tolerant", lambda: "new", ttl=300, stale_ttl=300) == "new"  # revalidated
    assert metrics["cache_rebuild"] == 3 and metrics["cache_hit"] == 1


def test_a_cache_whose_jitter_or_lease_would_keep_nothing_is_refused(rc):
    """``Cache(client, prefix, jitter=1.5)`` (web code builds its own) stored each entry already
    past its freshness (ttl x (1 - 1.5 x r) below 0 half the time): every read rebuilt it, a
    negative jitter kept it past its ttl, and a lease_ttl under a millisecond failed every miss in
    Redis (``invalid expire time``)."""
    client, prefix = rc
    for options in ({"jitter": 1}, {"jitter": 1.5}, {"jitter": -0.5}, {"jitter": float("nan")}, {"jitter": "0.1"},
                    {"lease_ttl": 0}, {"lease_ttl": float("inf")}, {"wait": -1}, {"wait": float("nan")}):
        with pytest.raises(ValueError, match=f"cache {next(iter(options))} must be"):
            Cache(client, prefix, **options)
    cache = Cache(client, prefix, jitter=0, lease_ttl=0.0001)
    assert cache.get_or_build("k", lambda: "built", ttl=60) == "built"
    assert client.pttl(f"{prefix}cache:k") > 59_000


def test_an_entry_is_read_and_judged_fresh_while_redis_refuses_writes(tmp_path):
    """Out of memory under ``noeviction`` (a broker's Redis) or a read-only replica, Redis still
    answers reads: an entry and what is left of its life are read in one step that writes nothing
    (a MULTI was refused whole under OOM: every read went to the database, no hit at all)."""
    from .servers import RedisServer

    server = RedisServer(tmp_path).start()
    client = server.client(socket_timeout=5)
    try:
        metrics = {}
        cache = Cache(client, "p:", metrics)
        assert cache.get_or_build("k", lambda: "cached", ttl=300) == "cached"
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", 1)  # every write refused, reads answered
        assert cache.get_or_build("k", lambda: "from the database", ttl=300) == "cached"
        assert metrics == {"cache_miss": 1, "cache_rebuild": 1, "cache_hit": 1}
    finally:
        client.close()
        server.stop()
