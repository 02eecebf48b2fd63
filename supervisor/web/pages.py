"""The HTML views (GET). Each reads the broker through ``Fetch``: an outage is a banner, never an error page."""
import collections
import math
import time

from starlette.responses import RedirectResponse

from .. import scheduler
from ..errors import BadInput
from . import auth, csrf
from .console import gate, refuse
from .formbody import LOGIN_LIMIT, BodyRefused, read_form
from .forms import form_values, job_filter, query_string
from .live import queue_rows

PAGE_SIZE = 50
PARENTS_SHOWN = 100  # a job's parents listed on its page
DEAD_LISTED = 300  # dead letters grouped on the page: the most recent ones, a bounded read


def console_of(request):
    return request.app.state.console


@gate()
async def overview(request):
    c = console_of(request)
    snap = c.sampler.snapshot
    if snap["at"] is None:  # the console just started: read now rather than show nothing
        snap = await c.sampler.sample()
    return c.render(request, "overview.html", problems=snap["problems"], snap=snap)


@gate()
async def jobs(request):
    c = console_of(request)
    fetch = c.fetch()
    values = form_values(request.query_params)
    cursor = request.query_params.get("cursor") or None
    order = request.query_params.get("order") or "newest"
    error, page = None, None
    try:
        flt = job_filter(values, time.time(), c.redactor)
        page = await fetch("searching jobs", lambda b: b.search(flt, cursor, PAGE_SIZE, order))
    except BadInput as exc:
        error = str(exc)
    rows = [c.redactor.job_dict(j) for j in page.jobs] if page else []
    next_link = None
    if page is not None and page.next_cursor:
        next_link = "/jobs?" + query_string(values, cursor=page.next_cursor, order=order)
    # A short page that still has a next one: a filter checked job by job stopped at its bound
    # (scan.SCAN_BOUND), not at the last match. "No job matches" would be a lie.
    partial = next_link is not None and len(rows) < PAGE_SIZE
    # The count comes after the page, from /api/jobs/count: a count that scans (a payload
    # field on a large broker) never holds up the first page.
    count_link = "/api/jobs/count?" + query_string(values) if page is not None else None
    return c.render(request, "jobs.html", problems=fetch.problems, values=values, error=error, jobs=rows,
                    count_link=count_link, next_link=next_link, order=order, paged=bool(cursor), partial=partial,
                    first_link="/jobs?" + query_string(values, order=order),
                    states=_states(), queues=c.cfg.broker.queues)


def _states():
    from ..jobfilter import FILTER_STATES

    return FILTER_STATES


@gate()
async def job(request):
    c = console_of(request)
    fetch = c.fetch()
    job_id = request.path_params["job_id"]
    found = await fetch("reading jobs", lambda b: b.get(job_id))
    if found is None:
        if fetch.problems:
            return c.render(request, "error.html", status=503, problems=fetch.problems, code=503,
                            message=f"job {job_id} cannot be read while the broker is unreachable")
        return c.render(request, "error.html", status=404, code=404, message=f"no job {job_id}")
    d = c.redactor.job_dict(found)
    parents = await parent_rows(fetch, d.get("parents"))
    return c.render(request, "job.html", problems=fetch.problems, job=d, attempts=attempts(d["history"]),
                    parents=parents, parents_total=len(d.get("parents") or ()))


def _states_now(broker, ids):
    out = {}
    for parent_id in ids:
        job = broker.get(parent_id)
        out[parent_id] = job.state if job is not None else None
    return out


async def parent_rows(fetch, parents):
    """The jobs a workflow child waits (or waited) on, each with its state now and the end its edge
    recorded; a parent pruned since shows its recorded end. At most ``PARENTS_SHOWN`` (a group's
    callback may have thousands): one read each."""
    if not parents:
        return []
    shown = sorted(parents)[:PARENTS_SHOWN]
    now = await fetch("reading jobs", _states_now, shown, default=None)  # None: unreadable, not gone
    return [{"id": p, "state": (now or {}).get(p), "gone": now is not None and now.get(p) is None,
             "ended": parents[p][0]} for p in shown]


def attempts(history):
    """The history as rows: each attempt with its outcome, error, host, pid and duration."""
    rows = []
    for entry in history or ():
        if not isinstance(entry, dict):
            continue
        started, ended = entry.get("started_at"), entry.get("ended_at")
        error = entry.get("error") if isinstance(entry.get("error"), dict) else None
        known = {"attempt", "outcome", "started_at", "ended_at", "owner", "error", "host", "pid", "duration"}
        rows.append({"attempt": entry.get("attempt"), "outcome": entry.get("outcome") or "running",
                     "started_at": started, "ended_at": ended, "owner": entry.get("owner"),
                     "host": entry.get("host"), "pid": entry.get("pid"),
                     "took": entry.get("duration") if entry.get("duration") is not None else (
                         ended - started if started is not None and ended is not None else None),
                     "error": error, "extra": {k: v for k, v in entry.items() if k not in known}})
    return rows


@gate()
async def dead(request):
    c = console_of(request)
    fetch = c.fetch()
    listed = await fetch("dead letters", lambda b: b.dlq_list(None, DEAD_LISTED), default=[])
    groups = collections.OrderedDict()
    for j in listed:
        key = (j.type, j.reason or "-")
        g = groups.setdefault(key, {"type": j.type, "reason": j.reason or "-", "count": 0, "newest": None,
                                    "oldest": None})
        g["count"] += 1
        t = j.last_failure_at or j.finished_at
        if t is not None:
            g["newest"] = t if g["newest"] is None else max(g["newest"], t)
            g["oldest"] = t if g["oldest"] is None else min(g["oldest"], t)
    rows = [c.redactor.job_dict(j) for j in listed[:50]]
    return c.render(request, "dead.html", problems=fetch.problems, groups=list(groups.values()), jobs=rows,
                    listed=len(listed), capped=len(listed) >= DEAD_LISTED, tasks=c.tasks.listing())


@gate()
async def queues(request):
    c = console_of(request)
    fetch = c.fetch()
    # Counts from the sampler (a second old; counting is what a deep queue makes slow), pauses read now.
    paused = await fetch("pausing queues", lambda b: b.paused(), default=None)
    rows = c.sampler.queue_rows(paused or {}) if paused is not None else c.sampler.snapshot["queues"]
    # Paused since the last sample (from the command line, a queue no job was ever in): on-call
    # must see every pause, so its counts are read now rather than a second later.
    missing = [q for q in paused or {} if q not in {r["queue"] for r in rows}]
    if missing:
        stats = await fetch("queue statistics", lambda b: b.stats(missing), default=None)
        rows = rows + (queue_rows(stats, paused) if stats else
                       [{"queue": q, "ready": "-", "scheduled": "-", "in_flight": "-", "oldest_ready_age": None,
                         "paused": True}
                        for q in missing])
    return c.render(request, "queues.html", problems=fetch.problems, rows=rows, paused=paused or {},
                    at=c.sampler.snapshot["at"])


def schedule_listing(cfg, now):
    """The config's periodic jobs with their next run and the tick before it (whose job, if any, is the last run)."""
    out = []
    for name, s in sorted(scheduler.schedules_from(cfg, {}).items()):
        previous = s.latest(now, 1)
        out.append({"name": name, "cron": s.cron, "timezone": s.timezone, "type": s.type, "queue": s.queue,
                    "payload": s.payload, "next_run": s.next_after(now),
                    "last_tick": previous[0] if previous else None,
                    "last_key": scheduler.tick_key(name, previous[0]) if previous else None})
    return out


@gate()
async def schedules(request):
    from ..jobfilter import JobFilter

    c = console_of(request)
    fetch = c.fetch()
    listing = schedule_listing(c.cfg, time.time())
    for item in listing:
        item["payload"] = c.redactor.value(item["payload"])
        item["last_job"] = None
        if item["last_key"] and not fetch.problems:
            # Its job was enqueued at the tick or later (a catch-up): the time bound keeps the lookup
            # to the jobs since then instead of every job the broker holds.
            flt = JobFilter(idempotency_key=item["last_key"], queued_after=item["last_tick"] - 60)
            page = await fetch("searching jobs", lambda b, f=flt: b.search(f, None, 1))
            if page is not None and page.jobs:
                item["last_job"] = {"id": page.jobs[0].id, "state": page.jobs[0].state}
    return c.render(request, "schedules.html", problems=fetch.problems, schedules=listing)


@gate()
async def supervisors(request):
    c = console_of(request)
    fetch = c.fetch()
    records = await fetch("supervisor records", lambda b: b.supervisors(), default=[])
    records = sorted(records or [], key=lambda r: (bool(r.get("gone")), str(r.get("host")), str(r.get("id"))))
    return c.render(request, "supervisors.html", problems=fetch.problems, records=records, now=time.time())


# -- login ---------------------------------------------------------------------------

async def login_form(request):
    c = console_of(request)
    request.state.identity = None
    return c.render(request, "login.html", next=_safe_next(request.query_params.get("next")), error=None,
                    open=not auth.auth_configured(c.web))


async def login(request):
    c = console_of(request)
    request.state.identity = None
    try:
        form = await read_form(request, LOGIN_LIMIT)  # before anyone has logged in: a small body or nothing
    except BodyRefused as exc:
        return c.render(request, "login.html", status=exc.status, next="/", error=str(exc), open=False)
    nxt = _safe_next(form.get("next"))
    if not csrf.valid(request, None, form):
        return c.render(request, "login.html", status=403, next=nxt, error="The form expired: try again.",
                        open=False)
    address = request.client.host if request.client else "-"
    tried = auth.Identity(str(form.get("name") or "-")[:64], "-", "session")
    wait = c.logins.wait(address)
    if wait:
        c.audit(tried, "login_throttled", 0, address=address)
        page = c.render(request, "login.html", status=429, next=nxt, open=False,
                        error=f"Too many failed logins from this address: try again in {math.ceil(wait)} s.")
        page.headers["Retry-After"] = str(math.ceil(wait))
        return page
    c.logins.failed(address)  # counted before the check, which runs off the loop: parallel tries stay within the limit
    identity = await c.check_password(form.get("name"), form.get("password"))
    if identity is None:
        c.audit(tried, "login_refused", 0, address=address)
        return c.render(request, "login.html", status=401, next=nxt, error="Wrong name or password.", open=False)
    c.logins.succeeded(address)
    c.sessions.end(request.session.get("sid"))
    request.session.clear()  # a fresh session (and CSRF token) for the new identity
    request.session.update(user=identity.name, sid=c.sessions.start())
    c.audit(identity, "login", 0)
    return RedirectResponse(nxt, status_code=303)


async def logout(request):
    try:
        form = await read_form(request, LOGIN_LIMIT)
    except BodyRefused as exc:
        request.state.identity = None
        return refuse(console_of(request), request, "page", exc.status, str(exc))
    if csrf.valid(request, None, form):
        console_of(request).sessions.end(request.session.get("sid"))  # a copy of the cookie is no good either
        request.session.clear()
    return RedirectResponse("/login", status_code=303)


def _safe_next(value):
    # Only a path on this site: never an open redirect.
    if isinstance(value, str) and value.startswith("/") and not value.startswith("//") and "\\" not in value:
        return value
    return "/"
