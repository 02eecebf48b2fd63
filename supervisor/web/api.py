"""The JSON API under ``/api/``: what the pages show and do, for scripts, behind the same auth.

Read with a bearer token (``Authorization: Bearer ...``) or a session; a change
also needs the admin role, and with a session the ``X-CSRF-Token`` header.
Errors are ``{"error": "..."}`` with 400 (bad input), 401, 403, 404, 501 (the
broker does not offer it) or 503 (the broker is unreachable). Every job is
redacted like on the pages.
"""
import json
import time

from starlette.responses import JSONResponse

from ..backends.control import REQUEUE_REFUSALS, count_acting
from ..errors import BadInput
from ..jobfilter import JobFilter
from . import actions
from .console import gate
from .forms import form_values, job_filter


def console_of(request):
    return request.app.state.console


def answer(data, status=200):
    return JSONResponse(json.loads(json.dumps(data, default=str)), status_code=status)


async def body(request):
    """The JSON object the gate read (``formbody.read_json``: JSON only, capped)."""
    try:
        data = json.loads(request.state.body)
    except (ValueError, RecursionError):  # RecursionError: nested too deep to decode
        raise BadInput("the body must be a JSON object") from None
    if not isinstance(data, dict):
        raise BadInput("the body must be a JSON object")
    return data


@gate("api")
async def overview(request):
    return answer(console_of(request).sampler.snapshot)


@gate("api")
async def jobs(request):
    c = console_of(request)
    q = request.query_params
    flt = job_filter(form_values(q), time.time(), c.redactor)
    try:
        limit = int(q.get("limit") or 50)
    except ValueError:
        raise BadInput(f"limit: expected an integer, got {q.get('limit')!r}") from None
    page = await c.pool.call(lambda b: b.search(flt, q.get("cursor") or None, limit, q.get("order") or "newest"))
    return answer({"jobs": [c.redactor.job_dict(j) for j in page.jobs], "next_cursor": page.next_cursor})


@gate("api")
async def count(request):
    c = console_of(request)
    flt = job_filter(form_values(request.query_params), time.time(), c.redactor)
    n = await c.pool.call(lambda b: b.count(flt))
    return answer({"count": n.n, "exact": n.exact})


@gate("api")
async def job(request):
    c = console_of(request)
    job_id = request.path_params["job_id"]
    found = await c.pool.call(lambda b: b.get(job_id))
    if found is None:
        return answer({"error": f"no job {job_id}"}, 404)
    return answer(c.redactor.job_dict(found))


@gate("api")
async def dead(request):
    c = console_of(request)
    listed = await c.pool.call(lambda b: b.dlq_list(request.query_params.get("type") or None, 100))
    return answer({"jobs": [c.redactor.job_dict(j) for j in listed]})


@gate("api")
async def queues(request):
    c = console_of(request)
    paused = await c.pool.call(lambda b: b.paused())
    return answer({"queues": c.sampler.queue_rows(paused), "at": c.sampler.snapshot["at"]})


@gate("api")
async def supervisors(request):
    records = await console_of(request).pool.call(lambda b: b.supervisors())
    return answer({"supervisors": records})


@gate("api")
async def schedules(request):
    from .pages import schedule_listing

    c = console_of(request)
    listing = schedule_listing(c.cfg, time.time())
    for item in listing:
        item["payload"] = c.redactor.value(item["payload"])
    return answer({"schedules": listing})


@gate("api", admin=True)
async def jobs_action(request, form):
    """POST /api/jobs/{action} with ``{"ids": [...]}`` or ``{"filter": {...}}`` (JobFilter keys)."""
    c = console_of(request)
    action = actions.check_action(request.path_params["action"])  # a dry run too: it counted for any name
    data = await body(request)
    ids, flt = data.get("ids"), data.get("filter")
    if (ids is None) == (flt is None):
        raise BadInput('give either "ids" (a list) or "filter" (an object)')
    if ids is not None:
        if not isinstance(ids, list):
            raise BadInput('"ids" must be a list of job ids')
        outcome, more = await actions.bulk(c, request.state.identity, action, ids=ids)
    else:
        flt = JobFilter.from_dict(flt)
        for key, _ in flt.payload:
            if c.redactor.covers(key):
                raise BadInput(f"filter: payload.{key} is redacted and cannot be searched")
        if not flt:
            raise BadInput("this filter selects every job: narrow it first")
        if data.get("dry_run"):
            n, exact = await c.pool.call(count_acting, action, flt)
            refusals = {"may_refuse": list(REQUEUE_REFUSALS)} if action == "retry" else {}
            return answer({"dry_run": True, "count": n, "exact": exact, **refusals})
        outcome, more = await actions.bulk(c, request.state.identity, action, flt=flt)
    return answer({"outcome": outcome, "more": more})


@gate("api", admin=True)
async def job_action(request, form):
    c = console_of(request)
    job_id = request.path_params["job_id"]
    outcome = await actions.job_action(c, request.state.identity, job_id, request.path_params["action"])
    if outcome == "unknown":  # as GET /api/jobs/ID says: a 200 read as done by a script checking the status
        return answer({"error": f"no job {job_id}"}, 404)
    return answer({"outcome": outcome})


@gate("api", admin=True)
async def queue_action(request, form):
    c = console_of(request)
    name = request.path_params.get("queue")
    names = await actions.queue_action(c, request.state.identity, request.path_params["action"], name)
    return answer({request.path_params["action"] + "d": names})


@gate("api", admin=True)
async def dead_action(request, form):
    c = console_of(request)
    data = await body(request)
    args = dict(ids=data.get("ids") or [], group_type=data.get("type"), group_reason=data.get("reason"))
    if not isinstance(args["ids"], list):
        raise BadInput('"ids" must be a list of job ids')
    what = request.path_params["action"]
    if what == "replay":
        text = await actions.dead_replay(c, request.state.identity, rate=actions.parse_rate(
            str(data["rate"]) if data.get("rate") is not None else None), **args)
    elif what == "purge":
        text = await actions.dead_purge(c, request.state.identity, **args)
    else:
        raise BadInput(f"unknown action {what!r} (replay or purge)")
    return answer({"outcome": text})
