"""``tangguh status --watch``: a live view redrawn in place, fit for a plain terminal over SSH.

``render_watch`` is pure (a status reply, an earlier one, the time in; text
out). Rates are the difference of the status ``counters`` between the newest
sample and the oldest one kept from the last minute, so they need no metric
history in the daemon. Samples and redraws are timed on the monotonic clock;
the wall clock only labels the screen, so a step of it (NTP, a manual set)
neither stalls the rates nor holds back or hurries a redraw. The screen is redrawn with two plain ANSI sequences
(home, clear): no curses, no terminal database.
"""
import collections
import sys
import time

from .output import duration, table

WINDOW = 60.0  # seconds of samples the rates are computed over
CLEAR = "\033[H\033[2J"
RATES = ("succeeded", "failed", "retried", "dead", "timeouts", "crashed", "lease_lost")


def same_run(a, b):
    """Whether two status replies come from one run of one supervisor (its counters go on).

    The pid alone does not tell: a supervisor that is a container's first process is
    pid 1 after every restart. Its start time does."""
    return a.get("pid") == b.get("pid") and a.get("started_at") == b.get("started_at")


def rates(newer, older):
    """Per-minute rates of the counters between two ``(t, reply)`` samples, or None if unknown."""
    if older is None or newer is None:
        return None
    (t1, r1), (t0, r0) = newer, older
    c1, c0 = r1.get("counters") or {}, r0.get("counters") or {}
    if t1 <= t0 or not same_run(r1, r0):
        return None  # the same instant, or another supervisor (restarted): counters started over
    out = {}
    for name in RATES:
        if isinstance(c1.get(name), (int, float)) and isinstance(c0.get(name), (int, float)):
            out[name] = max(0.0, c1[name] - c0[name]) * 60.0 / (t1 - t0)
    return out


def render_watch(reply, now, older=None, at=None):
    """One screen for ``reply`` (a status reply sampled at ``now``, wall time); ``older`` is
    ``(t, reply)`` or None, ``t`` on the clock of ``at``: this sample's instant (default ``now``)."""
    at = now if at is None else at
    stamp = time.strftime("%H:%M:%S", time.localtime(now))
    if reply.get("error") and "workers" not in reply:
        return f"tangguh status --watch  {stamp}\nerror: {reply['error']}"
    started = reply.get("started_at")
    up = f"up {duration(now - started)}" if isinstance(started, (int, float)) else ""
    state = "stopping" if reply.get("stopping") else "running"
    if reply.get("broker_down"):
        state += ", BROKER DOWN"
    if reply.get("reload_error"):
        state += ", LAST RELOAD FAILED"
    lines = [f"tangguh  pid {reply.get('pid', '-')}  gen {reply.get('generation', '-')}  {up}  {state}  {stamp}"]

    queues = reply.get("queues") or {}
    if queues:
        rows = [[q, s.get("ready"), s.get("scheduled"), s.get("waiting", "-"), s.get("in_flight"), s.get("dead"),
                 duration(s.get("oldest_ready_age")) if s.get("ready") else "-"] for q, s in queues.items()]
        lines += ["", table(["QUEUE", "READY", "SCHEDULED", "WAITING", "IN FLIGHT", "DEAD", "OLDEST"], rows)]
    if reply.get("queues_sample_failing"):
        # The last counts stand while the new ones fail (a count the broker gives up on): say how old.
        age = reply.get("queues_sampled_ago")
        if queues and age is not None:
            lines.append(f"queue counts {duration(age)} old: the samples since failed (sample_failed in the log)")
        else:
            lines += ["", "no queue counts yet: the samples failed (sample_failed in the log)"]

    workers = reply.get("workers") or []
    busy = sum(1 for w in workers if w.get("job_id"))
    lines += ["", f"workers {len(workers)}/{reply.get('target_workers', '-')}  busy {busy}  "
                  f"restarts {reply.get('restarts', 0)}"]
    if workers:
        rows = [[w.get("slot"), w.get("pid"), w.get("state"), w.get("job_type") or "-", w.get("job_id") or "-",
                 w.get("attempt") if w.get("job_id") else "-",
                 duration(w.get("elapsed")) if w.get("job_id") and w.get("elapsed") is not None else "-"]
                for w in workers]
        lines.append(table(["SLOT", "PID", "STATE", "TYPE", "JOB", "ATTEMPT", "ELAPSED"], rows))

    per_minute = rates((at, reply), older)
    lines.append("")
    if per_minute is None:
        lines.append("rates: waiting for a second sample")
    else:
        span = at - older[0]
        lines.append(f"rates over the last {duration(span)}, per minute: "
                     + "  ".join(f"{name} {per_minute[name]:.1f}" for name in RATES if name in per_minute))
    counters = reply.get("counters") or {}
    if counters:
        lines.append("totals: " + "  ".join(f"{k} {v}" for k, v in sorted(counters.items())))
    return "\n".join(lines)


class Samples:
    """The status replies of the last ``WINDOW`` seconds, oldest first."""

    def __init__(self, window=WINDOW):
        self.window = window
        self.items = collections.deque()

    def add(self, t, reply):
        if reply.get("error") and "workers" not in reply:
            return
        if self.items and not same_run(self.items[-1][1], reply):
            # Restarted: its counters started over. Kept, the old run's samples would stay the
            # oldest for a whole window, and no rate could be shown until they left it.
            self.items.clear()
        self.items.append((t, reply))
        while len(self.items) > 2 and self.items[1][0] <= t - self.window:
            self.items.popleft()  # keep one sample at or past the window's start

    def oldest(self):
        return self.items[0] if self.items else None


def next_tick(due, now, interval):
    """When the redraw after the one due at ``due`` is due, ``now`` being the monotonic time:
    ``interval`` later, however long fetching and drawing took; ``interval`` from now when that
    has passed already (a slow answer, a suspended laptop), not a burst of late screens."""
    due += interval
    return due if due > now else now + interval


def run(fetch, interval=1.0, out=None, clock=time.monotonic, sleep=time.sleep, frames=None, wall=time.time):
    """Redraw every ``interval`` seconds until Ctrl-C (or ``frames`` screens, for tests).
    ``clock`` (monotonic) times the samples and the redraws; ``wall`` only labels the screen."""
    out = out or sys.stdout
    samples = Samples()
    drawn = 0
    due = clock()
    try:
        while frames is None or drawn < frames:
            at = clock()
            reply = fetch()
            older = samples.oldest()
            samples.add(at, reply)
            out.write(CLEAR + render_watch(reply, wall(), older, at=at) + "\n")
            out.flush()
            drawn += 1
            if frames is None or drawn < frames:
                now = clock()
                due = next_tick(due, now, interval)
                sleep(due - now)
    except KeyboardInterrupt:
        out.write("\n")
    return 0


def run_json(fetch, interval, write, clock=time.monotonic, sleep=time.sleep, count=None):
    """``--watch --json``: ``write`` each reply, one every ``interval`` seconds until Ctrl-C (or
    ``count`` replies, for tests), timed on ``clock`` as ``run`` times its screens."""
    written = 0
    due = clock()
    try:
        while count is None or written < count:
            write(fetch())
            written += 1
            if count is None or written < count:
                now = clock()
                due = next_tick(due, now, interval)
                sleep(due - now)
    except KeyboardInterrupt:
        pass
    return 0
