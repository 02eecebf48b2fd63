"""A Redis cache-aside that does not lie: ``ctx.cache``.

Read with ``get_or_build(key, builder, ttl, tags=[...])``; in the transaction that changes the data,
``invalidate_after_commit(tx, name)`` (docs/safe-handlers.md shows both in use).

* **TTL jitter**: each entry lives ``ttl`` minus up to ``jitter`` of it, so entries filled together do not
  expire together.
* **Single flight**: a miss takes a short *fill lease* (``SET NX``) before reading the database; only the
  holder builds. Others poll for its value up to ``wait`` seconds, then build for themselves without
  storing. In a job, the master holds the lease like a lock: extended while the build runs, freed at once if
  the child dies, so the next reader builds and stores. A lease whose answer was lost is asked again with
  its token (as a lock).
* **Fill leases cancelled by invalidation**: an invalidation deletes the entry *and* the outstanding fill
  lease; the store is a compare-and-set on the lease token, so a builder that read the old row before the
  writer committed cannot store it afterwards. Tags are registered when the lease is taken, before the
  database read, so invalidating a tag reaches fills in flight too. The store keeps each tag at least as
  long as the entry (a tag gone during a very long build stores nothing), and taking a lease drops from its
  tags a few members with neither entry nor lease: a tag refilled but never invalidated stays about the size
  of its live keys.
* **Stale-while-revalidate**, only for keys that say they tolerate it (``stale_ttl > 0``): after ``ttl`` the
  entry is kept ``stale_ttl`` seconds more; one reader (the lease holder) rebuilds, the others get the stale
  value at once. An invalidation removes stale entries too.
* ``invalidate(*names)`` / ``invalidate_after_commit(tx, *names)``: each name is a key, a tag, or both; a
  tag removes every key filled under it (``invoice:123`` -> summary, list pages, aggregates). After commit
  means never before (a reader could refill from the old row) and never on rollback. A tag of more than
  ``invalidate_batch`` (500) members goes in batches, one short script each (the Redis may be the broker's
  too); when the call returns, every entry filled under it before is gone.
* With Redis unreachable, or refusing writes (out of memory under ``noeviction``, a read-only replica),
  ``get_or_build`` returns ``builder()`` (nothing stored); Redis failing so after the builder ran (the
  store) leaves the value unstored, never builds it twice; a value over the server's ``proto-max-bulk-len``
  too, its fill lease freed. ``invalidate`` raises, so the job fails and its
  retry, finding its idempotency record done, invalidates again.
* Freshness is judged by Redis's clock (what is left of the entry's life), never by a reader's.
* Counters: ``cache_hit``, ``cache_miss``, ``cache_rebuild`` (the builder ran), ``cache_stale_served``.

Values are stored as JSON, and every call returns the value as JSON gives it back (tuples as lists, dict
keys as strings), on a miss as on a hit; a value JSON cannot hold (``Decimal``, ``datetime``) raises
``TypeError`` naming the key (convert it in the builder). Redis keys: ``<prefix>cache:<key>``,
``<prefix>cache-lease:<key>``, ``<prefix>cache-tag:<tag>``; the scripts build key names from the prefix, so
use one Redis instance, not a cluster. Keys, tags and names are non-empty text (``ValueError`` otherwise;
tags a list of them): the text is the name.
"""
import json
import logging
import random
import time
import uuid

import redis as redis_py

from .. import protocol
from ..child import timeouts
from .cachescripts import DROP_MEMBERS, INVALIDATE, READ, STORE, TAKE_LEASE
from .locks import RELEASE, check_name, shown, unanswered

log = logging.getLogger("tangguh.cache")

# Redis away, or answering but refusing to write: the cache is only a copy, so its reader goes to the source
# of truth (an OOM under ``maxmemory`` + ``noeviction`` made every read fail, and threw away a value built).
UNAVAILABLE = (redis_py.ConnectionError, redis_py.TimeoutError, redis_py.OutOfMemoryError, redis_py.ReadOnlyError)


def _count(metrics, name):
    metrics[name] = metrics.get(name, 0) + 1


def _dumps(key, value):
    try:
        return json.dumps(value)
    except (TypeError, ValueError, RecursionError) as exc:
        raise TypeError(f"cache value for key {key!r} is not JSON: {exc}") from None


MAX_TTL = 10 * 365 * 86400.0  # seconds: past it Redis refuses the expiry, after the builder ran


def _seconds(name, value, zero_ok):
    """A TTL argument: a finite number of seconds up to ``MAX_TTL`` (above 0, or 0 too), else
    ValueError: NaN and inf failed deep in the call, a TTL past Redis's range after the builder
    ran (its lease held to the end), and 0 or below stored entries that were never fresh."""
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not value <= MAX_TTL
            or not (value >= 0 if zero_ok else value > 0)):
        raise ValueError(f"cache {name} must be a number of seconds {'from 0' if zero_ok else 'above 0'}"
                         f" to {MAX_TTL:.0f}, got {value!r}")
    return value


def _tags(tags):
    """``tags`` as a tuple of names: one string is refused (it iterated as a tag per letter), and a
    generator is read once (the lease read it, the store found it empty)."""
    if isinstance(tags, (str, bytes)):
        raise ValueError(f"cache tags must be a list of names, got {type(tags).__name__} {shown(repr(tags))}")
    return tuple(check_name("cache tag", tag) for tag in tags)


def _round_trip(key, value):
    """``value`` as a hit would return it (tuples become lists, keys strings), whether stored or not."""
    return json.loads(_dumps(key, value))


class Cache:
    """``ctx.cache``: ``get_or_build``, ``invalidate``, ``invalidate_after_commit``.

    ``client``/``prefix`` come from ``toolkit.redis()``; ``metrics`` is the
    job's counter dict. Usable outside a job too (web code reading the same
    cache): ``Cache(redis.Redis(...), prefix)``.
    """

    def __init__(self, client, prefix="", metrics=None, jitter=0.1, lease_ttl=10.0, wait=2.0, notify=None):
        # A jitter of 1 or more stored entries past their freshness (rebuilt at every read), one below 0
        # kept them past their ttl, and a lease under a millisecond failed every miss in Redis.
        if isinstance(jitter, bool) or not isinstance(jitter, (int, float)) or not 0 <= jitter < 1:
            raise ValueError(f"cache jitter must be a fraction from 0 to below 1, got {jitter!r}")
        _seconds("lease_ttl", lease_ttl, zero_ok=False)
        _seconds("wait", wait, zero_ok=True)
        self.client, self.prefix = client, prefix
        self.metrics = metrics if metrics is not None else {}
        self.jitter, self.lease_ttl, self.wait = jitter, lease_ttl, wait
        # Members per script of a tag's invalidation: about 1 ms of Redis time each.
        self.invalidate_batch = 500
        # In a child: tells the master of each fill lease, as of a lock. It extends a long build's
        # lease with the job's, and frees a dead builder's at once: the next reader builds (and
        # stores) instead of every reader building for itself until the lease ran out.
        self.notify = notify

    def _key(self, key):
        return f"{self.prefix}cache:{key}"

    def _lease(self, key):
        return f"{self.prefix}cache-lease:{key}"

    def _tag(self, tag):
        return f"{self.prefix}cache-tag:{tag}"

    def get_or_build(self, key, builder, ttl, tags=(), stale_ttl=0.0, wait=None):
        """The value for ``key``: cached, or ``builder()``'s (stored only under a valid fill lease).

        ``ttl`` seconds fresh (minus jitter); ``tags`` names to invalidate it
        by; ``stale_ttl`` > 0 marks the key tolerant of stale reads for that
        many seconds past ``ttl``; ``wait`` bounds the wait on another builder.
        """
        key, tags = check_name("cache key", key), _tags(tags)
        _seconds("ttl", ttl, zero_ok=False)
        _seconds("stale_ttl", stale_ttl, zero_ok=True)
        if wait is not None:  # NaN never ended the wait on another builder; inf waited out its lease
            _seconds("wait", wait, zero_ok=True)
        ran, missed = [], []  # the builder ran; the miss is counted (the read answered)

        def build():
            ran.append(True)
            return builder()

        try:
            return self._get_or_build(key, build, ttl, tags, stale_ttl, wait, missed)
        except UNAVAILABLE as exc:
            if ran:
                raise  # raised by the builder itself: running it again would read (and do) it all twice
            # Cache-aside: with the cache away, read the source of truth. Nothing
            # is stored, so nothing stale can be left behind.
            log.warning("cache unavailable, building %s directly: %s", shown(key), exc)
            if not missed:  # a read that answered (the lease's script failed) counted it: one miss
                _count(self.metrics, "cache_miss")
            _count(self.metrics, "cache_rebuild")
            return _round_trip(key, builder())

    def _get_or_build(self, key, builder, ttl, tags, stale_ttl, wait, missed):
        wait = self.wait if wait is None else wait
        entry = self._read(key)
        if entry is not None and entry["fresh"]:
            _count(self.metrics, "cache_hit")
            return entry["v"]
        if entry is not None:  # stale, and the key tolerates it
            token = self._claim(key, tags, ttl, stale_ttl, if_absent=False)
            if token is None:
                _count(self.metrics, "cache_stale_served")
                return entry["v"]
            return self._build(key, builder, ttl, stale_ttl, token, tags)
        _count(self.metrics, "cache_miss")
        missed.append(True)
        deadline = time.monotonic() + wait
        pause = 0.005
        while True:
            # Atomic with the check that the key is still absent: a builder that
            # stored between our read and this call must not be followed by a
            # second build.
            token = self._claim(key, tags, ttl, stale_ttl, deadline=deadline)
            if token is not None:
                return self._build(key, builder, ttl, stale_ttl, token, tags)
            entry = self._read(key)  # filled meanwhile, or being filled by another process
            if entry is not None:
                return entry["v"]
            if time.monotonic() >= deadline:
                break
            time.sleep(pause * random.uniform(0.5, 1.5))  # jittered: the waiters do not poll in step
            pause = min(0.1, pause * 2)
        _count(self.metrics, "cache_rebuild")
        return _round_trip(key, builder())  # waited long enough: build for this caller, store nothing

    def invalidate(self, *names):
        """Delete the entries (and cancel the fill leases) of keys and tags ``names`` now."""
        names = [check_name("cache name", name) for name in names]
        if not names:
            return
        batch = self.invalidate_batch
        for i in self.client.eval(INVALIDATE, 0, self.prefix, batch, *names):
            name = names[int(i)]
            # Every member there at the start is visited (SSCAN's promise), so each entry filled
            # before now is deleted, or its lease is and the store refused. A member added since
            # was leased after the write committed: visiting it or not, nothing old is stored.
            cursor = None
            while cursor != 0:
                cursor, members = self.client.sscan(self._tag(name), cursor or 0, count=batch)
                for start in range(0, len(members), batch):
                    self.client.eval(DROP_MEMBERS, 0, self.prefix, name, *members[start:start + batch])

    def invalidate_after_commit(self, tx, *names):
        """``invalidate(*names)`` once ``tx`` commits; nothing if it rolls back."""
        names = [check_name("cache name", name) for name in names]  # refused now, while the job can still fail
        tx.after_commit(lambda: self.invalidate(*names))

    # -- internals --------------------------------------------------------------------
    def _read(self, key):
        """The entry of ``key`` or None, ``fresh`` while Redis has more than its stale tail (``stale``, ms)
        of its life left. A filler's wall-clock time read on each reader's clock had a reader ahead rebuild
        at every read, one behind serve stale as fresh. An earlier version's entry has only that time."""
        raw, left = self.client.eval(READ, 1, self._key(key))
        if raw is None:
            return None
        entry = json.loads(raw)
        entry["fresh"] = left > entry["stale"] or left == -1 if "stale" in entry else entry["fresh"] > time.time()
        return entry

    def _take_lease(self, key, tags, ttl, stale_ttl, if_absent=True, tell=None, deadline=None):
        """Our fill-lease token, or None (another holds it, or ``if_absent`` and the key has a value).

        An answer lost (the server may have taken the lease) is asked once more with the same token,
        which the script takes as ours; ``tell(token)`` first, so the master frees a lease the server
        took even when the second try fails too (the reader then builds for itself, as a lock's acquire).
        A timeout past ``deadline`` (the reader's wait spent; None: it waits for nobody) is not asked
        again: a stalled Redis cost a second socket timeout inside ``critical()``."""
        token = uuid.uuid4().hex
        tag_ms = int((ttl + stale_ttl + self.lease_ttl) * 1000) + 1000
        keys = [self._lease(key), self._key(key)] + [self._tag(t) for t in tags]
        mode = "absent" if if_absent else "any"
        args = (TAKE_LEASE, len(keys), *keys, token, max(1, int(self.lease_ttl * 1000)), key, tag_ms, mode, self.prefix)
        try:
            taken = self.client.eval(*args)
        except Exception as error:  # noqa: BLE001 - narrowed below
            if not unanswered(error):
                raise
            if tell is not None:
                tell(token)
            if isinstance(error, redis_py.TimeoutError) and (deadline is None or time.monotonic() >= deadline):
                log.warning("fill lease of %s: no answer, its wait spent (%s)", shown(key), error)
                raise
            log.warning("fill lease of %s: no answer, asked again (%s)", shown(key), error)
            taken = self.client.eval(*args)
        return token if taken == 1 else None

    def _claim(self, key, tags, ttl, stale_ttl, if_absent=True, deadline=None):
        """``_take_lease`` for a build, the master told of the lease in the same critical block: a
        soft timeout or a cancel raised between the two left a lease nobody would free, and every
        reader of the key waited ``wait`` and built unstored until it expired (a job's lease)."""
        told = []  # the master heard of the token already (an answer was lost)

        def tell(token):
            told.append(token)
            self.notify({"op": protocol.LOCK, "key": self._lease(key), "token": token, "ttl": self.lease_ttl})

        with timeouts.critical():
            token = self._take_lease(key, tags, ttl, stale_ttl, if_absent, tell if self.notify else None, deadline)
            if token is not None and self.notify is not None and not told:
                tell(token)
        return token

    def _build(self, key, builder, ttl, stale_ttl, token, tags):
        """Run the builder under our lease (``_claim`` told the master); store its value only if the lease survived."""
        if self.notify is None:
            return self._build_leased(key, builder, ttl, stale_ttl, token, tags)
        try:
            return self._build_leased(key, builder, ttl, stale_ttl, token, tags)
        finally:
            with timeouts.critical():  # a soft timeout or a cancel raised mid-write tore the frame
                self.notify({"op": protocol.UNLOCK, "key": self._lease(key), "token": token})

    def _build_leased(self, key, builder, ttl, stale_ttl, token, tags):
        _count(self.metrics, "cache_rebuild")
        try:
            entry, ms = self._entry(key, builder(), ttl, stale_ttl)
        except BaseException:
            # A value that cannot be stored fails like a builder that raised: the
            # lease goes now, or every other reader would wait it out and build
            # without storing until it expires.
            self._release(key, token)
            raise
        try:
            self._store(key, entry, ms, token, tags)
        except redis_py.RedisError as exc:
            # The value is built: hand it over rather than build it again. A value over the server's
            # proto-max-bulk-len fails so too, as a protocol error or as the connection Redis drops.
            log.warning("cache unavailable, %s not stored: %s", shown(key), exc)
            # Redis may answer though the store failed: the next reader need not wait the lease out
            # and build unstored. Only a stalled Redis (a timeout) is not asked again.
            if not isinstance(exc, redis_py.TimeoutError):
                self._release(key, token)
        return json.loads(entry)["v"]

    def _release(self, key, token):
        try:
            self.client.eval(RELEASE, 1, self._lease(key), token)  # a lock's release: the token's owner only
        except redis_py.RedisError as exc:
            log.warning("cannot release the fill lease of %s (it expires by itself): %s", shown(key), exc)

    def _entry(self, key, value, ttl, stale_ttl):
        """``(the JSON entry, its lifetime in ms)``; a value JSON cannot hold is a TypeError naming ``key``."""
        _seconds("ttl", ttl, zero_ok=False)  # store() by hand too
        _seconds("stale_ttl", stale_ttl, zero_ok=True)
        fresh = ttl * (1 - self.jitter * random.random())
        entry = _dumps(key, {"v": value, "fresh": time.time() + fresh, "stale": int(stale_ttl * 1000)})
        return entry, max(1, int((fresh + stale_ttl) * 1000))

    def _store(self, key, entry, ms, token, tags):
        keys = [self._lease(key), self._key(key)] + [self._tag(t) for t in tags]
        tag_ms = ms + int(self.lease_ttl * 1000)
        return bool(self.client.eval(STORE, len(keys), *keys, token, entry, ms, key, tag_ms))

    def store(self, key, value, ttl, token, stale_ttl=0.0, tags=()):
        """Store ``value`` if fill lease ``token`` is still valid; False if an invalidation cancelled it.

        ``tags``: those the lease was taken with (they are kept as long as the entry).
        """
        key, tags = check_name("cache key", key), _tags(tags)
        entry, ms = self._entry(key, value, ttl, stale_ttl)
        return self._store(key, entry, ms, token, tags)

    def lease(self, key, ttl, tags=(), stale_ttl=0.0):
        """Take the fill lease of ``key`` by hand: its token, or None when another holds it.

        For callers that fill in two steps (``lease``, then ``store``).
        """
        key, tags = check_name("cache key", key), _tags(tags)
        _seconds("ttl", ttl, zero_ok=False)  # a lease no store() could fill is refused now, not then
        _seconds("stale_ttl", stale_ttl, zero_ok=True)
        return self._take_lease(key, tags, ttl, stale_ttl, if_absent=False)
