"""Live figures: one sampler for every browser, and the server-sent event streams.

The sampler reads the queues, the pause flags and the supervisors' records once
a second, whatever the number of open browsers, and keeps an hour of done and
dead totals (a bounded deque) from which the overview's charts are drawn. Each
stream only forwards the latest snapshot, so five browsers cost what one does.
"""
import asyncio
import collections
import json
import logging
import time

from .brokerio import Fetch

log = logging.getLogger("tangguh.web")

WINDOW = 3600.0  # seconds of history the charts show
BUCKET = 30.0  # seconds per bar
INTERVAL = 1.0  # seconds between samples (the live update's latency)


async def known_queues(fetch, configured):
    """The config's queues, then every other queue the broker knows of (when it can say)."""
    queues = list(configured)
    found = await fetch("a queue listing", lambda b: b.queues(), default=None)
    for q in found or ():
        if q not in queues:
            queues.append(q)
    return queues


def queue_rows(stats, paused):
    rows = []
    for name, s in (stats or {}).items():
        d = s.to_dict()
        d["paused"] = bool(d.get("paused")) or name in (paused or {})
        d["retrying"] = d.get("retrying", 0)
        rows.append(d)
    return rows


async def read_queues(fetch, configured):
    """Each queue's counts and pause flag; None when the broker cannot be read."""
    queues = await known_queues(fetch, configured)
    stats = await fetch("queue statistics", lambda b: b.stats(queues), default=None)
    if stats is None:
        return None
    paused = await fetch("pausing queues", lambda b: b.paused(), default={})
    return queue_rows(stats, paused)


class Sampler:
    def __init__(self, pool, configured_queues, interval=INTERVAL):
        self.pool = pool
        self.configured = configured_queues
        self.interval = interval
        self.history = collections.deque(maxlen=int(WINDOW / interval) + 1)  # (t, done, dead)
        self.snapshot = {"at": None, "queues": [], "supervisors": [], "problems": ["No sample yet."],
                         "series": series([], time.time())}
        self.version = 0

    async def sample(self):
        fetch = Fetch(self.pool)
        rows = await read_queues(fetch, self.configured)
        supervisors = []
        if rows is not None:  # an outage: one failed call, not three timeouts
            supervisors = await fetch("supervisor records", lambda b: b.supervisors(), default=[])
            self.history.append((time.time(), sum(r["done"] for r in rows), sum(r["dead"] for r in rows)))
        now = time.time()
        if rows is None:  # unreachable: the last figures read, under the banner that says they may be stale
            # ("No supervisor records" during an outage read as every supervisor gone)
            rows, supervisors = self.snapshot["queues"], self.snapshot["supervisors"]
        self.snapshot = {"at": now, "queues": rows, "supervisors": supervisors, "problems": fetch.problems,
                         "series": series(self.history, now)}
        self.version += 1
        return self.snapshot

    async def run(self):
        while True:
            started = time.monotonic()
            try:
                await self.sample()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the loop outlives any one bad sample
                log.exception("console sampler failed", extra={"event": "web_sample_failed"})
            # A broker whose counts are slow (a deep SQLite queue) is read at most half the time.
            await asyncio.sleep(max(self.interval, time.monotonic() - started))

    def queue_rows(self, paused):
        """The last sample's queues with ``paused`` (read just now) applied: the Queues page after a click."""
        rows = [dict(r) for r in self.snapshot["queues"]]
        for r in rows:
            r["paused"] = r["queue"] in paused
        return rows


def series(history, now):
    """Done and dead per ``BUCKET`` over the last ``WINDOW``: the charts' bars, oldest first.

    A total that drops (finished jobs pruned, dead letters replayed) counts as 0, not negative.
    """
    n = int(WINDOW / BUCKET)
    done, dead = [0] * n, [0] * n
    start = now - WINDOW
    previous = None
    for t, d, x in history:
        if previous is not None and t >= start:
            i = min(n - 1, int((t - start) / BUCKET))
            done[i] += max(0, d - previous[0])
            dead[i] += max(0, x - previous[1])
        previous = (d, x)
    return {"bucket": BUCKET, "done": done, "dead": dead}


def event(name, data):
    return f"event: {name}\ndata: {json.dumps(data, default=str, separators=(',', ':'))}\n\n"


async def overview_stream(request, sampler):
    seen = None
    quiet = 0
    while not await request.is_disconnected():
        if sampler.version != seen:
            seen = sampler.version
            quiet = 0
            yield event("overview", sampler.snapshot)
        else:
            quiet += 1
            if quiet >= 15:  # a comment now and then: proxies close streams that stay silent
                quiet = 0
                yield ": keep-alive\n\n"
        await asyncio.sleep(sampler.interval / 2)


async def job_stream(request, pool, redactor, job_id, finished_states, when, pretty, interval=INTERVAL):
    """The job's state and progress whenever they change; ends once it is finished.

    An outage is a ``problems`` event (and an empty one when it ends): the page says so
    instead of showing the last state and progress as if they were current.
    """
    last, trouble = None, None  # the first read says either way: a banner from before it may be stale
    while not await request.is_disconnected():
        fetch = Fetch(pool)
        job = await fetch("reading jobs", lambda b: b.get(job_id))
        if fetch.problems != trouble:
            trouble = fetch.problems
            yield event("problems", {"problems": trouble})
        if job is None and not fetch.problems:
            yield event("gone", {"id": job_id})
            return
        if job is not None:
            d = redactor.job_dict(job)
            view = {k: v for k, v in d.items()
                    if k in ("id", "state", "reason", "progress", "progress_note", "attempt", "owner",
                             "lease_until", "finished_at", "cancel_request")}
            # Shown as the page shows them, so the script only swaps text.
            view["finished_text"] = when(job.finished_at)
            view["result_text"] = "-" if d["result"] is None else pretty(d["result"])
            if view != last:
                last = view
                yield event("job", view)
            if job.state in finished_states:
                return
        await asyncio.sleep(interval)
