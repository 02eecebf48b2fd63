"""Periodic jobs: enqueue one job per cron tick, once across every supervisor.

Every supervisor runs the same schedules from its master's main loop (no
thread of its own: docs/design.md's fork rule); the arbiter calls ``tick`` when
``due_at`` has passed and sleeps no longer than until then. Each tick's job
is enqueued with ``broker.enqueue_once`` under the key
``cron:<name>:<tick time, UTC>``. Why not the plain enqueue dedup: it only
covers unfinished jobs, so a job that finished before a slower supervisor got
to the same tick would run twice. ``enqueue_once`` keeps a small record per
key (until ``prune`` passes the retention horizon), atomically with the
enqueue: exactly one job per tick, however many supervisors, however fast
the job.

Catch-up: a check enqueues the ticks due since the previous check, at most
``catch_up`` of them (the latest; at least one while running). A scheduler's
first check of a schedule (a start, a reload that changed its cron or time
zone) looks back to the schedule's newest tick: ``enqueue_once(job,
schedule=name)`` records it by the schedule's exact name, a record ``prune``
never removes, and ``broker.last_tick_key(name)`` reads it (one lookup). The
ticks after it were missed while every supervisor was down, and the latest
``catch_up`` of them run (``catch_up = 0``: none). A schedule without a record
is new and starts from now: no tick from before it existed runs. A record
that is not a tick key of that name (not the scheduler's) is logged and read
as none. Ticks older than the retention horizon are skipped: their
``enqueue_once`` records may be pruned already. One ``tick`` call enqueues at most
``TICKS_PER_CALL`` jobs; the rest stay due for the next loop turn, so a long
catch-up never holds the master's loop for long. A
reload that keeps a schedule's ticks (its cron and time zone) keeps its last
check (``carry_over``), so a tick due during the reload is caught up like any
other late tick, whatever ``catch_up`` says. Times are the broker's clock
(``broker.now()``), so supervisors agree on it.
"""
import dataclasses
import datetime
import logging

from .errors import BadInput, ConfigError

log = logging.getLogger("tangguh.scheduler")

TICKS_PER_CALL = 100  # jobs one tick() call (one turn of the master's loop) enqueues at most
MAX_CATCH_UP = 1000  # the largest catch_up the config accepts
STAMP = "%Y-%m-%dT%H:%M:%SZ"


def catch_up_count(v):
    """The config's check of ``catch_up``: an integer from 0 to ``MAX_CATCH_UP``."""
    if isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_CATCH_UP:
        return v
    raise ValueError(f"expected an integer from 0 to {MAX_CATCH_UP}")


@dataclasses.dataclass
class Schedule:
    name: str
    cron: str
    type: str
    payload: dict
    queue: str | None = None
    timezone: str = "UTC"
    catch_up: int = 1
    _fixed: bool | None = dataclasses.field(default=None, init=False, repr=False, compare=False)

    def ticks_like(self, other):
        """Whether ``other`` ticks at the same instants under the same keys."""
        return (self.name, self.cron, self.timezone) == (other.name, other.cron, other.timezone)

    def _iter(self, t):
        # Imported on first use: a daemon without schedules never loads croniter and
        # dateutil, about 2 MiB in the master that every child shares (zoneinfo 0.3 more).
        import croniter

        return croniter.croniter(self.cron, datetime.datetime.fromtimestamp(t, _zone(self.timezone)))

    def _repeated(self, tick):
        """Whether ``tick`` is a fixed-time schedule's second run at one local time (the hour a
        DST fall-back repeats): like vixie cron, a schedule whose minute and hour fields are
        not wildcards runs once per wall-clock time; ``*`` and ``*/N`` ones run by the clock."""
        if self._fixed is None:
            fields = self.cron.split()
            # croniter reads a macro in any case (checks.cron accepts "@HOURLY"): so does this.
            self._fixed = (fields[0].lower() != "@hourly" if len(fields) == 1
                           else not (fields[0].startswith("*") or fields[1].startswith("*")))
        return self._fixed and datetime.datetime.fromtimestamp(tick, _zone(self.timezone)).fold == 1

    def next_after(self, t):
        """The first tick strictly after epoch ``t``."""
        it = self._iter(t)
        tick = it.get_next(float)
        while self._repeated(tick):
            tick = it.get_next(float)
        return tick

    def latest(self, t, count, after=None):
        """Up to ``count`` ticks ``<= t`` (and ``> after``), oldest first."""
        out = []
        it = self._iter(t + 1e-6)  # get_prev is strictly before its start: include a tick at t itself
        while len(out) < count:
            tick = it.get_prev(float)
            if after is not None and tick <= after:
                break
            if not self._repeated(tick):
                out.append(tick)
        return out[::-1]


def _zone(name):
    import zoneinfo  # on first use, as croniter (Schedule._iter); ZoneInfo caches each zone itself

    return zoneinfo.ZoneInfo(name)


def tick_prefix(name):
    return f"cron:{name}:"


def tick_key(name, tick):
    stamp = datetime.datetime.fromtimestamp(tick, datetime.timezone.utc).strftime(STAMP)
    return tick_prefix(name) + stamp  # fixed width: key order is tick order


def key_tick(name, key):
    """The tick (epoch seconds) of ``name``'s ``tick_key``; None for any other key (another
    schedule's, one with no stamp, such as ``cron:<name>:manual``)."""
    prefix = tick_prefix(name)
    if not key.startswith(prefix) or len(key) != len(prefix) + len("2026-01-01T00:00:00Z"):
        return None
    try:
        stamp = datetime.datetime.strptime(key[len(prefix):], STAMP)
    except ValueError:
        return None
    return stamp.replace(tzinfo=datetime.timezone.utc).timestamp()


def schedules_from(cfg, handlers):
    """``[schedules.<name>]`` plus every handler's ``cron=`` (named for its type), by name. A schedule
    without a ``queue`` of its own goes to its type's queue as ``.enqueue()`` does:
    ``[jobs.types.<type>].queue`` over the decorator's ``queue=`` (None: the default queue)."""
    out = {}
    for type_name, spec in sorted(handlers.items()):
        if spec.cron:
            out[type_name] = Schedule(type_name, spec.cron, type_name, {}, cfg.job_type(type_name).queue or spec.queue)
    for name, sc in cfg.schedules.items():
        # The client only knows the config's queue for a type; the decorator's is the handler's.
        spec = handlers.get(sc.type)
        queue = sc.queue or cfg.job_type(sc.type).queue or (spec.queue if spec is not None else None)
        out[name] = Schedule(name, sc.cron, sc.type, dict(sc.payload), queue, sc.timezone, sc.catch_up)
    return out


class Scheduler:
    """Which schedules are due and what they enqueue; one per master.

    ``new_job(schedule, key)`` builds the ``NewJob`` (the arbiter's client
    applies the config's queue and attempt defaults). ``horizon``: seconds a
    tick may be late and still be enqueued (None: no limit).
    """

    def __init__(self, schedules, new_job, horizon=None):
        self.schedules = schedules
        self.new_job = new_job
        self.horizon = horizon
        self.checked = {}  # name -> broker time of the last check
        self.next_at = {}  # name -> the next tick after that check
        self.failing = {}  # name -> what it last failed with, its cron or its job (logged once)

    def due_at(self):
        """Broker time of the soonest tick to check, or None without schedules; -inf before the first check."""
        if not self.schedules:
            return None
        if len(self.next_at) < len(self.schedules):
            return float("-inf")
        return min(self.next_at.values())

    def tick(self, broker, now=None):
        """Enqueue the due ticks; returns ``[(name, tick, job id or None)]``. BrokerError propagates:
        what was not enqueued stays due and is retried on the next call."""
        now = broker.now() if now is None else now
        done = []
        budget = TICKS_PER_CALL
        for name, sched in self.schedules.items():
            if self.next_at.get(name, float("-inf")) > now:
                continue
            if budget <= 0:
                break  # the schedules left are still due: the next loop turn goes on
            after = self.checked.get(name)
            count = max(1, sched.catch_up)
            if after is None:  # look back to this schedule's newest tick, if it ever had one
                newest = self._newest_tick(broker, name)
                after, count = (now, 0) if newest is None else (newest, sched.catch_up)
            if self.horizon is not None:
                after = max(after, now - self.horizon)
            ticks = self._cron(name, sched.latest, [], now, count, after)
            if len(ticks) > budget:  # the oldest first; from the last one enqueued on, the next turn
                ticks = ticks[:budget]
                now_for = ticks[-1]
            else:
                now_for = now
            budget -= len(ticks)
            for tick in ticks:
                key = tick_key(name, tick)
                try:
                    job = self.new_job(sched, key)
                except BadInput as exc:  # a decorator's queue the config does not serve (check_schedules)
                    self._failed(name, f"cannot enqueue: {exc}")
                    break
                job_id = broker.enqueue_once(job, schedule=name)
                self.failing.pop(name, None)  # recovered: its next failure is news again
                done.append((name, tick, job_id))
                if job_id is not None:
                    log.info("periodic job %s enqueued for %s", name, key,
                             extra={"event": "schedule", "schedule": name, "job_id": job_id, "key": key})
            self.checked[name] = now_for
            self.next_at[name] = self._cron(name, sched.next_after, float("inf"), now) if now_for == now else now_for
        return done

    def _newest_tick(self, broker, name):
        """The tick of ``name``'s record, or None: new, or a record that is no tick key of
        its own (logged). Never a parse error: tick() must raise nothing but the broker's
        errors, or the broker link pauses every claim."""
        key = broker.last_tick_key(name)
        tick = None if key is None else key_tick(name, key)
        if key is not None and tick is None:
            log.error("schedule %s: its newest tick record %r is no tick of it; it starts from now", name, key,
                      extra={"event": "schedule_failed", "schedule": name})
        return tick

    def _cron(self, name, compute, failed, *args):
        """``compute(*args)``, or ``failed`` when the schedule's own cron fails (croniter): that is
        logged once and stays this schedule's, never the broker link's (it would pause every claim)."""
        try:
            return compute(*args)
        except Exception as exc:  # noqa: BLE001 - croniter's errors, not the broker's: it is not called here
            self._failed(name, f"cannot compute its ticks: {type(exc).__name__}: {exc}")
            return failed

    def _failed(self, name, text):
        """Log ``text`` once while it is what ``name`` fails with: every later tick fails alike, and
        one line a tick (every second, for some) would bury the rest of the log."""
        if self.failing.get(name) != text:
            log.error("schedule %s %s", name, text, extra={"event": "schedule_failed", "schedule": name})
        self.failing[name] = text

    def carry_over(self, old):
        """Keep ``old``'s last check of each schedule whose ticks are unchanged (same name, cron and
        time zone): a reload is not a start, and a tick due while it ran is still enqueued."""
        for name, sched in self.schedules.items():
            before = old.schedules.get(name)
            if before is not None and name in old.checked and before.ticks_like(sched):
                self.checked[name] = old.checked[name]
                self.next_at[name] = old.next_at[name]

    def listing(self, now):
        """Each schedule with its next run (broker time), for ``tangguh schedules``."""
        return [{"name": name, "cron": s.cron, "timezone": s.timezone, "type": s.type, "queue": s.queue,
                 "payload": s.payload, "catch_up": s.catch_up, "next_run": s.next_after(now)}
                for name, s in sorted(self.schedules.items())]


def check_schedules(cfg, handlers):
    """ConfigError for a schedule none of whose ticks could run: a job the client refuses to build
    (a name that makes the tick key longer than 255 characters: nothing would ever be stored) or a
    payload its handler's schema refuses (every tick dead-lettered bad_payload); start, reload and
    ``config check`` call it."""
    from . import schemas

    new_job = job_builder(cfg)
    for name, sched in sorted(schedules_from(cfg, handlers).items()):
        spec = handlers.get(sched.type)
        if sched.queue not in cfg.broker.queues:
            # Only a decorator's queue can be unserved: another supervisor sharing the handlers may
            # serve it and enqueue the ticks, so here it stays a tick's error (logged once).
            sched = dataclasses.replace(sched, queue=None)
        try:
            new_job(sched, tick_key(name, 0.0))  # tick keys are fixed width: any tick's is the longest
        except BadInput as exc:
            where = f"schedules.{name}" if name in cfg.schedules else f"{spec.source}: job {name!r}: cron="
            raise ConfigError(f"{where}: every tick's job would be refused: {exc}"
                              " (a tick's key is cron:<name>:<UTC time>)") from None
        if spec is None or spec.payload is None:
            continue
        try:
            schemas.load(spec.payload, sched.payload)
        except schemas.SchemaError as exc:
            where = f"schedules.{name}.payload" if name in cfg.schedules else \
                f"{spec.source}: job {name!r}: cron= enqueues payload {{}}, which its payload schema refuses"
            raise ConfigError(f"{where}: {exc}") from None


def job_builder(cfg):
    """``new_job(schedule, key)``: a tick's job, built like ``Client.new_job`` builds it from this config."""
    from .client import Client

    client = Client(cfg.broker.url, config=cfg)  # only builds jobs; it never opens the broker

    def new_job(sched, key):
        return client.new_job(sched.type, sched.payload, queue=sched.queue, idempotency_key=key)

    return new_job


def from_config(cfg, handlers):
    """The master's scheduler, building the jobs ``check_schedules`` built at load."""
    return Scheduler(schedules_from(cfg, handlers), job_builder(cfg), horizon=cfg.broker.retention or None)
