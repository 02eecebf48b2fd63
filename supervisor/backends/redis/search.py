"""The Redis broker's search, count and bulk actions (a mixin ``RedisBroker`` inherits).

Each queue has a search index, ``P:{Q}:search``: a sorted set of every job of
the queue at score 0 with member ``"<16-digit queued_at us><id>"``, so a
lexicographic range (``ZRANGEBYLEX``) is a ``(queued_at, id)`` range: the
page's key. Each type of job in the queue has one more, ``P:{Q}:search:type:T``,
with the same members for that type's jobs alone, and ``P:{Q}:search:types``
names the types that have one (prune walks it: see below).

Enqueue (``enqueue.lua``, which ``enqueue_once`` runs too, and
``enqueue_flow.lua``) adds a job's entry to both in its script: one ZADD more
per job for the type's, and one SADD per type and call. Claim, ack and every
other state change touch neither (the members never change: a job keeps its
queue, type and queued time). Discard, purge and prune remove both entries.
Entries of done jobs whose hash expired (``done_ttl``) are removed when a
search meets them (from the type's index too when that is the one read) and
by prune, which sweeps ``BATCH`` entries of the queue's index and ``BATCH`` of
its type indexes (type after type, ``P:{Q}:search:types:sweep`` remembers
where) per queue per call; a type whose index empties leaves the types set.
``migrate`` indexes jobs stored before the indexes existed, once (the flag
``P:search:ready:types``; a broker that had only the queue indexes runs it
again for the type indexes).

Which index serves which filter: a type filter reads that type's index in
each queue searched; without one, the queue's index. Either serves the queue
filter (only that queue's keys are read) and the queued time range (the
lexicographic bounds). A state filter on dead, done, cancelled, expired or
running jobs reads those states' own sorted sets instead, while they hold at
most ``STATE_DRIVE_MAX`` jobs (then a type filter is checked row by row).
Every other filter (resource_id, idempotency_key, finished range, error,
payload fields; queued, retrying and scheduled states) is a bounded scan of the index
read: a batch at a time with each job's fields (``search_page.lua``, one call
per queue and batch), checked here, at most ``scan.SCAN_BOUND`` jobs per call;
past it the page comes back short with a cursor that continues. Without a
queue filter the queues' indexes are merged.

``count`` without row-by-row filters is ``ZLEXCOUNT`` per queue on the index
read (O(log n): a count by type alone is exact at any size) or the size of the
state sets; with them, exact when a bounded scan finishes, otherwise that
number times the share of scanned jobs that matched, marked ``exact=False``.
"""
import json

from ...jobfilter import DUE_LATER, SCHEDULED, Count
from .. import control, scan
from .connection import guard
from .fields import to_job

SERVED = ("queue", "queued_after", "queued_before")
TYPE_SERVED = SERVED + ("type",)  # when the type's index drives
# States with a sorted set of their own (dead, done, cancelled, expired, leased): a search
# for them reads that set instead of walking the index, while the sets hold at most this many.
STATE_SETS = ("dead", "done", "cancelled", "expired", "running")
STATE_DRIVE_MAX = 20_000
_FIELDS = ("state", "type", "resource_id", "idempotency_key", "finished_at", "payload", "error")
# P:search:ready:types, set once every queue's existing jobs are in its index and their type's
# (P:search:ready meant the queue indexes alone, before the type indexes).
_BACKFILLED = "search:ready:types"


def _member_key(us, job_id):
    return f"{us:016d}{job_id}"


def _us(seconds):
    return int(round(seconds * 1e6))


_LAST_US = 10**16 - 1  # the index's members carry 16 digits of microseconds (the year 2286)


def _bound(seconds):
    """A time bound as the index's digits: clamped to them, or a bound past the year 2286 (more
    digits) would sort below every member and a search for later jobs would find them all."""
    return 0 if seconds <= 0 else _LAST_US if seconds >= _LAST_US / 1e6 else _us(seconds)


class SearchMixin:
    def _search_key(self, queue):
        self.keys.for_scripts(queue)  # checks the name
        return f"{self.prefix}:{{{queue}}}:search"

    def _type_key(self, queue, job_type):
        return f"{self._search_key(queue)}:type:{job_type}"

    def _index_key(self, queue, f):
        """The index a search with ``f`` reads in ``queue``: its type's when it names one."""
        return self._search_key(queue) if f.type is None else self._type_key(queue, f.type)

    def _search_queues(self, f):
        return [f.queue] if f.queue is not None else sorted(self.r.smembers(self.keys.queues))

    def _lex_range(self, f, after, order):
        """(min, max) lexicographic bounds of the page's range past ``after``."""
        low, high = "-", "+"
        if f.queued_after is not None:
            low = "[" + _member_key(_bound(f.queued_after), "")
        if f.queued_before is not None:
            high = "(" + _member_key(_bound(f.queued_before), "")
        if after is not None:
            edge = _member_key(_bound(after[0]), after[1])
            if order == "newest":
                high = "(" + edge if high == "+" or edge < high[1:] else high
            else:
                low = "(" + edge if low == "-" or edge > low[1:] else low
        return low, high

    def _fetcher(self, f, order, with_fields):
        queues = self._search_queues(f)
        # "scheduled": queued or retrying with run_at past this clock, as stats counts them
        now = self.now() if SCHEDULED in f.state else None

        def fetch(after, n):
            low, high = self._lex_range(f, after, order)
            fields = (_FIELDS + ("run_at",) if now is not None else _FIELDS) if with_fields else ()
            width = 1 + len(fields)
            calls = [("search_page", queue, [low, high, order, n, f.type or "", *fields]) for queue in queues]
            rows = []
            for queue, flat in zip(queues, self._run_many(calls) if calls else ()):
                for i in range(0, len(flat), width):
                    m = flat[i]
                    row = {"id": m[16:], "queued_at": int(m[:16]) / 1e6, "queue": queue, "_member": m}
                    row.update(zip(fields, flat[i + 1:i + width]))
                    if now is not None:
                        row["later"] = row["state"] in DUE_LATER and float(row["run_at"] or 0) > now
                    rows.append(row)
            if len(queues) > 1:
                rows.sort(key=lambda r: r["_member"], reverse=order == "newest")
            return rows[:n]
        return fetch

    def _state_members(self, f, queues):
        """The index members of the jobs in ``f.state``, sorted, when every one of those states has
        a sorted set and they hold at most ``STATE_DRIVE_MAX`` jobs; None otherwise."""
        if not f.state or not set(f.state) <= set(STATE_SETS) or not queues:
            return None
        states = list(f.state)
        if sum(self._run_many([("search_sizes", q, states) for q in queues])) > STATE_DRIVE_MAX:
            return None
        got = self._run_many([("search_states", q, states) for q in queues])
        return sorted((m, q) for q, members in zip(queues, got) for m in members)

    def _list_fetcher(self, f, members, order, with_fields):
        """``fetch`` over members already in hand (``_state_members``)."""
        def fetch(after, n):
            low, high = self._lex_range(f, after, order)
            inside = [(m, q) for m, q in (reversed(members) if order == "newest" else members)
                      if (low == "-" or (m >= low[1:] if low[0] == "[" else m > low[1:]))
                      and (high == "+" or (m <= high[1:] if high[0] == "[" else m < high[1:]))][:n]
            rows = [{"id": m[16:], "queued_at": int(m[:16]) / 1e6, "queue": q, "_member": m} for m, q in inside]
            if with_fields and rows:
                pipe = self.r.pipeline(transaction=False)
                for row in rows:
                    pipe.hmget(self.keys.job(row["queue"], row["id"]), *_FIELDS)
                for row, values in zip(rows, pipe.execute()):
                    row.update(zip(_FIELDS, values))
            return rows
        fetch.members = members
        return fetch

    def _plan(self, f, order):
        """(fetch, post filters): from the state sets when they are small, else from the type's
        index when the filter names a type, else from the queue's."""
        members = self._state_members(f, self._search_queues(f))
        if members is None:
            post = scan.post_names(f, SERVED if f.type is None else TYPE_SERVED)
            return self._fetcher(f, order, bool(post)), post
        post = [name for name in scan.post_names(f, SERVED) if name != "state"]
        return self._list_fetcher(f, members, order, bool(post)), post

    def _loader(self, rows_by_id):
        def load(ids):
            if not ids:
                return []
            pipe = self.r.pipeline(transaction=False)
            for job_id in ids:
                pipe.hgetall(self.keys.job(rows_by_id[job_id], job_id))
            return [to_job(fields) for fields in pipe.execute() if fields]
        return load

    @guard
    def search(self, filter, cursor=None, limit=50, order="newest"):
        f, after = scan.start(filter, cursor, limit, order)
        fetch, post = self._plan(f, order)
        queue_of = {}

        def remember(after, n):
            rows = fetch(after, n)
            queue_of.update((r["id"], r["queue"]) for r in rows)
            return rows

        return scan.search_jobs(remember, self._loader(queue_of), f, after, limit, order, post)

    @guard
    def count(self, filter, exact_up_to=10_000):
        f, _ = scan.start(filter, None, 1, "newest")
        fetch, post = self._plan(f, "newest")
        if getattr(fetch, "members", None) is not None and not post:
            n = len(fetch(None, len(fetch.members)))
            return Count(n, n <= exact_up_to)
        queues = self._search_queues(f)

        def indexed():
            low, high = self._lex_range(f, None, "newest")
            pipe = self.r.pipeline(transaction=False)
            for queue in queues:
                pipe.zlexcount(self._index_key(queue, f), low, high)
            return sum(pipe.execute())

        members = getattr(fetch, "members", None)
        total = (lambda: len(members)) if members is not None else indexed
        return scan.count_jobs(fetch, lambda cap: total(), total, f, exact_up_to, post)

    def _per_id(self, script, job_ids):
        """Run ``script`` on the ids grouped by queue; {id: outcome} in the order given."""
        job_ids = list(dict.fromkeys(job_ids))
        where = self._locator.queues_of(job_ids)
        groups = {}
        for job_id in job_ids:
            if job_id in where:
                groups.setdefault(where[job_id], []).append(job_id)
        out = {job_id: "unknown" for job_id in job_ids}
        calls = [(script, queue, ids) for queue, ids in groups.items()]
        for (_, _, ids), outcomes in zip(calls, self._run_many(calls) if calls else ()):
            out.update(zip(ids, outcomes))
        return out

    @guard
    def requeue(self, job_ids):
        return self._per_id("requeue", control.check_ids(job_ids, most=None))

    @guard
    def discard(self, job_ids):
        out = self._per_id("discard", control.check_ids(job_ids, most=None))
        for job_id, outcome in out.items():
            if outcome == "discarded":
                self._locator.forget(job_id)
        return out

    def _backfill_search(self):
        """Put jobs stored before the search indexes existed into them (once per broker).

        Also indexes a workflow's jobs stored before enqueue_flow.lua indexed them."""
        flag = f"{self.prefix}:{_BACKFILLED}"
        if self.r.exists(flag):
            return
        for queue in sorted(self.r.smembers(self.keys.queues)):
            base = self.keys.job(queue, "")
            for keys in _chunks(self.r.scan_iter(match=_glob_escape(base) + "*", count=1000), 1000):
                pipe = self.r.pipeline(transaction=False)
                for key in keys:
                    pipe.hmget(key, "queued_at", "type")
                by_type = {}
                for key, (queued, job_type) in zip(keys, pipe.execute()):
                    if queued is not None and job_type is not None:
                        by_type.setdefault(job_type, {})[_member_key(_us(float(queued)), key[len(base):])] = 0
                if not by_type:
                    continue
                pipe = self.r.pipeline(transaction=False)
                for job_type, members in by_type.items():
                    pipe.zadd(self._search_key(queue), members, nx=True)
                    pipe.zadd(self._type_key(queue, job_type), members, nx=True)
                pipe.sadd(f"{self._search_key(queue)}:types", *by_type)
                pipe.execute()
        self.r.set(flag, json.dumps(True))


def _chunks(iterable, n):
    chunk = []
    for item in iterable:
        chunk.append(item)
        if len(chunk) == n:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _glob_escape(text):
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)
