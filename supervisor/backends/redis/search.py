"""The Redis broker's search, count and bulk actions (a mixin ``RedisBroker`` inherits).

Each queue has a search index, ``P:{Q}:search``: a sorted set of every job of
the queue at score 0 with member ``"<16-digit queued_at us><id>"``, so a
lexicographic range (``ZRANGEBYLEX``) is a ``(queued_at, id)`` range: the
page's key. Enqueue adds the entry in its script; discard, purge and prune
remove it; entries of done jobs whose hash expired (``done_ttl``) are removed
when a search meets them and by prune, which sweeps ``BATCH`` entries per
queue per call.

A queue filter and the queued time range are served by the index; every other
filter (state, type, resource_id, idempotency_key, finished range, error,
payload fields) is a bounded scan: the jobs of the range are read in pages
(one pipelined ``HMGET`` per page) and checked here, at most
``scan.SCAN_BOUND`` per call (then the page comes back short, with a cursor
that continues). Without a queue filter the queues' indexes are merged.

``count`` without those filters is ``ZLEXCOUNT`` per queue (O(log n)); with
them, exact when a bounded scan finishes, otherwise the index count times the
share of scanned jobs that matched, marked ``exact=False``.
"""
import json

from .. import scan
from .connection import guard
from .fields import to_job

SERVED = ("queue", "queued_after", "queued_before")
_FIELDS = ("state", "queue", "type", "resource_id", "idempotency_key", "queued_at", "finished_at", "payload", "error")
_BACKFILLED = "search:ready"  # P:search:ready, set once every queue's existing jobs are in the index


def _member_key(us, job_id):
    return f"{us:016d}{job_id}"


def _us(seconds):
    return int(round(seconds * 1e6))


class SearchMixin:
    def _search_key(self, queue):
        self.keys.for_scripts(queue)  # checks the name
        return f"{self.prefix}:{{{queue}}}:search"

    def _search_queues(self, f):
        return [f.queue] if f.queue is not None else sorted(self.r.smembers(self.keys.queues))

    def _lex_range(self, f, after, order):
        """(min, max) lexicographic bounds of the page's range past ``after``."""
        low, high = "-", "+"
        if f.queued_after is not None:
            low = "[" + _member_key(max(0, _us(f.queued_after)), "")
        if f.queued_before is not None:
            high = "(" + _member_key(max(0, _us(f.queued_before)), "")
        if after is not None:
            edge = _member_key(_us(after[0]), after[1])
            if order == "newest":
                high = "(" + edge if high == "+" or edge < high[1:] else high
            else:
                low = "(" + edge if low == "-" or edge > low[1:] else low
        return low, high

    def _fetcher(self, f, order, with_fields):
        queues = self._search_queues(f)

        def fetch(after, n):
            low, high = self._lex_range(f, after, order)
            pipe = self.r.pipeline(transaction=False)
            for queue in queues:
                if order == "newest":
                    pipe.zrevrangebylex(self._search_key(queue), high, low, start=0, num=n)
                else:
                    pipe.zrangebylex(self._search_key(queue), low, high, start=0, num=n)
            merged = sorted(((m, q) for q, members in zip(queues, pipe.execute()) for m in members),
                            reverse=order == "newest")[:n]
            rows = [{"id": m[16:], "queued_at": int(m[:16]) / 1e6, "queue": q, "_member": m} for m, q in merged]
            if with_fields and rows:
                pipe = self.r.pipeline(transaction=False)
                for row in rows:
                    pipe.hmget(self.keys.job(row["queue"], row["id"]), *_FIELDS)
                stale = []
                for row, values in zip(rows, pipe.execute()):
                    if values[0] is None:
                        stale.append(row)  # a done job whose hash expired
                        row["state"] = None
                        continue
                    row.update((k, v) for k, v in zip(_FIELDS, values) if k != "queued_at")
                self._drop_stale(stale)
            return rows
        return fetch

    def _drop_stale(self, rows):
        if rows:
            pipe = self.r.pipeline(transaction=False)
            for row in rows:
                pipe.zrem(self._search_key(row["queue"]), row["_member"])
            pipe.execute()

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
        post = scan.post_names(f, SERVED)
        fetch = self._fetcher(f, order, bool(post))
        queue_of = {}

        def remember(after, n):
            rows = fetch(after, n)
            queue_of.update((r["id"], r["queue"]) for r in rows)
            return rows

        return scan.search_jobs(remember, self._loader(queue_of), f, after, limit, order, post)

    @guard
    def count(self, filter, exact_up_to=10_000):
        f, _ = scan.start(filter, None, 1, "newest")
        post = scan.post_names(f, SERVED)
        queues = self._search_queues(f)

        def indexed():
            low, high = self._lex_range(f, None, "newest")
            pipe = self.r.pipeline(transaction=False)
            for queue in queues:
                pipe.zlexcount(self._search_key(queue), low, high)
            return sum(pipe.execute())

        return scan.count_jobs(self._fetcher(f, "newest", True), lambda cap: indexed(), indexed, f,
                               exact_up_to, post)

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
        return self._per_id("requeue", job_ids)

    @guard
    def discard(self, job_ids):
        out = self._per_id("discard", job_ids)
        for job_id, outcome in out.items():
            if outcome == "discarded":
                self._locator.forget(job_id)
        return out

    def _backfill_search(self):
        """Put jobs stored before the search index existed into it (once per broker)."""
        flag = f"{self.prefix}:{_BACKFILLED}"
        if self.r.exists(flag):
            return
        for queue in sorted(self.r.smembers(self.keys.queues)):
            base = self.keys.job(queue, "")
            for keys in _chunks(self.r.scan_iter(match=_glob_escape(base) + "*", count=1000), 1000):
                pipe = self.r.pipeline(transaction=False)
                for key in keys:
                    pipe.hget(key, "queued_at")
                members = {_member_key(_us(float(q)), k[len(base):]): 0
                           for k, q in zip(keys, pipe.execute()) if q is not None}
                if members:
                    self.r.zadd(self._search_key(queue), members, nx=True)
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
