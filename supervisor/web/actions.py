"""Every change the console can make, each logged as one JSON event (``Console.audit``).

The operations here are shared by the HTML forms (below) and the JSON API
(``api.py``). A bulk action by filter walks the filter's pages oldest first and
acts on at most ``BULK_CAP`` jobs per request, so one click cannot hold a
broker thread for an hour; the answer says when more remain.
"""
import asyncio
import collections
import time
from urllib.parse import quote

from starlette.responses import RedirectResponse

from ..backends.control import acting, count_acting
from ..errors import BadInput
from ..jobfilter import ORDERS
from ..model import NewJob, check_queue
from .console import gate
from .forms import form_values, job_filter, query_string

BULK_CAP = 10_000
ACTIONS = ("cancel", "retry", "discard")
REASON = "cancelled from the web console"


def act(broker, action, ids, by):
    if action == "cancel":
        return broker.cancel(ids, by, REASON)
    if action == "retry":
        return broker.requeue(ids)
    return broker.discard(ids)


def act_on_filter(broker, action, flt, by, cap=BULK_CAP):
    """``act`` on every job ``flt`` selects in a state ``action`` changes, page by page, up to
    ``cap``; returns (results, more left)."""
    results, cursor, flt = {}, None, acting(action, flt)
    if flt is None:
        return results, False
    while len(results) < cap:
        page = broker.search(flt, cursor, min(500, cap - len(results)), "oldest")
        if not page.jobs:
            return results, False
        results.update(act(broker, action, [j.id for j in page.jobs], by))
        cursor = page.next_cursor
        if not cursor:
            return results, False
    return results, True


def summary(results):
    """``{"cancelled": 3, "requested": 1}``: how each id came out."""
    return dict(collections.Counter(results.values()))


def check_action(action):
    if action not in ACTIONS:
        raise BadInput(f"action must be one of {', '.join(ACTIONS)}, got {action!r}")
    return action


def check_ids(ids):
    ids = [i for i in ids if isinstance(i, str) and i]
    if len(ids) > BULK_CAP:
        raise BadInput(f"at most {BULK_CAP} job ids at once, got {len(ids)}")
    return ids


async def bulk(console, identity, action, ids=None, flt=None):
    """Run a bulk action on ``ids`` or on what ``flt`` selects; returns (summary, more left)."""
    check_action(action)
    if ids is not None:
        results, more = await console.pool.call(act, action, check_ids(ids), identity.name), False
        console.audit(identity, action, len(results), job_ids=list(results), outcome=summary(results))
    else:
        results, more = await console.pool.call(act_on_filter, action, flt, identity.name)
        console.audit(identity, action, len(results), job_ids=list(results), filter=flt.to_dict(),
                      outcome=summary(results))
    return summary(results), more


def flash(request, text):
    request.session["flash"] = text[:500]


def describe(outcome, more):
    text = ", ".join(f"{n} {what}" for what, n in sorted(outcome.items())) or "nothing to do"
    return text + (f" (stopped at {BULK_CAP}: run it again for the rest)" if more else "")


# -- the Jobs page: bulk with a confirmation ---------------------------------------------

@gate(admin=True)
async def jobs_bulk(request, form):
    c = request.app.state.console
    action = check_action(form.get("action"))
    values = form_values(form)
    flt, ids = None, None
    if form.get("scope") == "filter":
        flt = job_filter(values, time.time(), c.redactor)
        if not flt and form.get("everything") != "yes":
            raise BadInput("this filter selects every job: narrow it first")
    else:
        ids = check_ids(form.getlist("ids"))
        if not ids:
            raise BadInput("no job selected")
    # The page's order goes back with its filter; anything else than an order the search takes is dropped.
    order = form.get("order") if form.get("order") in ORDERS else None
    back = "/jobs?" + query_string(values, order=order)
    if form.get("confirmed") != "yes":
        if flt is not None:
            n, exact = await c.pool.call(count_acting, action, flt)
        else:
            n, exact = len(ids), True
        return c.render(request, "confirm.html", action=action, n=n, exact=exact, scope=form.get("scope"),
                        ids=ids or [], values=values, order=order, back=back, cap=BULK_CAP)
    outcome, more = await bulk(c, request.state.identity, action, ids=ids, flt=flt)
    flash(request, f"{action}: {describe(outcome, more)}")
    return RedirectResponse(back, status_code=303)


# -- one job -------------------------------------------------------------------------

async def job_action(console, identity, job_id, action):
    """cancel, retry (put a finished job back), replay (enqueue a copy as a new job) or delete."""
    if action in ("cancel", "retry"):
        results = await console.pool.call(act, action, [job_id], identity.name)
        outcome = results.get(job_id, "unknown")
    elif action == "delete":
        outcome = (await console.pool.call(act, "discard", [job_id], identity.name)).get(job_id, "unknown")
    elif action == "replay":
        outcome = await console.pool.call(_replay_copy, job_id)
    else:
        raise BadInput(f"unknown action {action!r} (cancel, retry, replay or delete)")
    console.audit(identity, f"job_{action}", 1, job_ids=[job_id], outcome=outcome)
    return outcome


def _replay_copy(broker, job_id):
    job = broker.get(job_id)
    if job is None:
        return "unknown"
    copy = NewJob(job.type, job.payload, queue=job.queue, resource_id=job.resource_id,
                  max_attempts=job.max_attempts, timeout=job.timeout, priority=job.priority).validate()
    return "enqueued " + broker.enqueue(copy)


@gate(admin=True)
async def job_post(request, form):
    c = request.app.state.console
    job_id, action = request.path_params["job_id"], request.path_params["action"]
    outcome = await job_action(c, request.state.identity, job_id, action)
    flash(request, f"{action}: {outcome}")
    if action == "delete" and outcome == "discarded":
        return RedirectResponse("/jobs", status_code=303)
    target = outcome.split()[-1] if outcome.startswith("enqueued ") else job_id
    return RedirectResponse("/jobs/" + quote(target, safe=""), status_code=303)


# -- dead letters --------------------------------------------------------------------

def dead_ids(broker, form_ids, group_type, group_reason, cap=BULK_CAP):
    if form_ids:
        return check_ids(form_ids)
    if not group_type:
        raise BadInput("select dead jobs, or a group")
    return [j.id for j in broker.dlq_list(group_type, cap) if (j.reason or "-") == (group_reason or j.reason or "-")]


MIN_RATE, MAX_RATE = 0.01, 10_000  # slower than one replay in 100 s holds one of the Tasks.MAX slots for days


def parse_rate(text):
    if not text:
        return None
    try:
        rate = float(text)
    except ValueError:
        rate = -1
    if not MIN_RATE <= rate <= MAX_RATE:
        raise BadInput(f"rate: expected replays per second from {MIN_RATE:g} to {MAX_RATE}, got {text!r}")
    return rate


class Tasks:
    """Replays running at a rate in the console's loop: at most ``MAX`` at once, the last ``KEEP`` shown."""

    MAX, KEEP = 2, 10

    def __init__(self):
        self.items = collections.deque(maxlen=self.KEEP)
        self.running = set()

    def start(self, console, identity, ids, rate):
        if len(self.running) >= self.MAX:
            raise BadInput(f"{self.MAX} replays are running already: wait for one to finish")
        item = {"what": f"replay of {len(ids)} dead job(s) at {rate:g}/s by {identity.name}", "done": 0,
                "total": len(ids), "finished": False}
        self.items.appendleft(item)
        task = asyncio.get_running_loop().create_task(self._replay(console, identity, ids, rate, item))
        self.running.add(task)
        task.add_done_callback(self.running.discard)
        return item

    async def _replay(self, console, identity, ids, rate, item):
        batch = max(1, int(rate))  # one call a second at most
        try:
            for i in range(0, len(ids), batch):
                if i:  # paced between calls only: a pause after the last would hold the slot for nothing
                    await asyncio.sleep(batch / rate)
                chunk = ids[i:i + batch]
                replayed = await console.pool.call(lambda b: b.dlq_replay(chunk))
                item["done"] += len(replayed)
                # A line per call, not one at the end: a restart partway still leaves the record of what it did.
                console.audit(identity, "dlq_replay", len(replayed), job_ids=replayed, rate=rate,
                              progress=f"{item['done']} of {item['total']}")
        except Exception as exc:  # noqa: BLE001 - shown on the page; the console keeps serving
            item["error"] = str(exc)[:200]
            console.audit(identity, "dlq_replay_stopped", 0, rate=rate, progress=f"{item['done']} of {item['total']}",
                          error=item["error"])
        item["finished"] = True

    def listing(self):
        return list(self.items)


async def dead_replay(console, identity, ids=(), group_type=None, group_reason=None, rate=None):
    ids = await console.pool.call(dead_ids, list(ids), group_type, group_reason)
    if rate:
        console.tasks.start(console, identity, ids, rate)
        return f"replaying {len(ids)} at {rate:g}/s"
    replayed = await console.pool.call(lambda b: b.dlq_replay(ids))
    console.audit(identity, "dlq_replay", len(replayed), job_ids=replayed)
    return f"{len(replayed)} replayed"


async def dead_purge(console, identity, ids=(), group_type=None, group_reason=None):
    ids = await console.pool.call(dead_ids, list(ids), group_type, group_reason)
    purged = await console.pool.call(lambda b: b.dlq_purge(ids))
    console.audit(identity, "dlq_purge", purged, job_ids=ids)
    return f"{purged} purged"


@gate(admin=True)
async def dead_post(request, form):
    c = request.app.state.console
    what = request.path_params["action"]
    args = dict(ids=form.getlist("ids"), group_type=form.get("type") or None, group_reason=form.get("reason"))
    if what == "replay":
        text = await dead_replay(c, request.state.identity, rate=parse_rate(form.get("rate")), **args)
    elif what == "purge":
        text = await dead_purge(c, request.state.identity, **args)
    else:
        raise BadInput(f"unknown action {what!r}")
    flash(request, text)
    return RedirectResponse("/dead", status_code=303)


# -- queues and schedules -------------------------------------------------------------

async def queue_action(console, identity, action, queue):
    """Pause or resume one queue, or every known one (``queue`` None)."""
    if action not in ("pause", "resume"):
        raise BadInput(f"unknown action {action!r} (pause or resume)")
    names = [check_queue(queue)] if queue else [r["queue"] for r in console.sampler.snapshot["queues"]] or list(
        console.cfg.broker.queues)
    if not queue and action == "resume":
        # Every pause the broker holds, read now: one made since the last sample is resumed too.
        paused = await console.pool.call(lambda b: b.paused())
        names += [q for q in paused if q not in names]
    if not queue and action == "pause":
        # Every queue the broker knows, read now: one jobs went to since the last sample is paused too.
        known = await console.pool.call(lambda b: b.queues())
        names += [q for q in known if q not in names]
    for name in names:
        if action == "pause":
            await console.pool.call(lambda b, q=name: b.pause(q, identity.name))
        else:
            await console.pool.call(lambda b, q=name: b.resume(q))
    console.audit(identity, f"queue_{action}", 0, queues=names)
    return names


@gate(admin=True)
async def queue_post(request, form):
    c = request.app.state.console
    names = await queue_action(c, request.state.identity, request.path_params["action"], form.get("queue") or None)
    flash(request, f"{request.path_params['action']}d: {', '.join(names)}")
    return RedirectResponse("/queues", status_code=303)


async def run_schedule(console, identity, name):
    from ..client import Client
    from .pages import schedule_listing

    found = [s for s in schedule_listing(console.cfg, time.time()) if s["name"] == name]
    if not found:
        raise BadInput(f"no schedule {name!r} in the config")
    s = found[0]
    job = Client(console.cfg.broker.url, config=console.cfg).new_job(s["type"], s["payload"], queue=s["queue"])
    job_id = await console.pool.call(lambda b: b.enqueue(job))
    console.audit(identity, "schedule_run", 1, job_ids=[job_id], schedule=name)
    return job_id


@gate(admin=True)
async def schedule_post(request, form):
    c = request.app.state.console
    job_id = await run_schedule(c, request.state.identity, request.path_params["name"])
    flash(request, f"enqueued {job_id}")
    return RedirectResponse("/jobs/" + quote(job_id, safe=""), status_code=303)
