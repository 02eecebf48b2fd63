"""What every view shares: the console's state, the gate in front of each endpoint, rendering.

``gate(kind)`` wraps an endpoint: it finds who is asking (``auth.identify``),
sends a browser without a session to the login page (a script gets 401),
refuses a change from a viewer (403), a page's form that is not a small
urlencoded body or an API body over its cap (``formbody``: 415, 413, 400),
a change without the CSRF token (403), and
turns whatever the endpoint raises into a page or JSON answer without a
traceback: BadInput into 400 with its message, an outage into 503.
"""
import asyncio
import concurrent.futures
import datetime
import functools
import json
import logging
import os
import time
from urllib.parse import quote, urlsplit

from starlette.responses import JSONResponse, RedirectResponse
from starlette.templating import Jinja2Templates

from ..errors import BadInput, BrokerError
from ..model import FINISHED
from . import auth, csrf
from .brokerio import BrokerPool, Fetch, unreachable, unsupported
from .formbody import BodyRefused, read_form, read_json
from .live import Sampler
from .redact import Redactor
from .throttle import LoginThrottle

log = logging.getLogger("tangguh.web")
HERE = os.path.dirname(os.path.abspath(__file__))
SESSION_AGE = 12 * 3600  # seconds a login lasts (the cookie's max-age, and the session's)

NAV = [("/", "Overview"), ("/jobs", "Jobs"), ("/dead", "Dead letters"), ("/queues", "Queues"),
       ("/schedules", "Schedules"), ("/supervisors", "Supervisors")]


class Console:
    def __init__(self, cfg, sample_interval=1.0):
        self.cfg = cfg
        self.web = cfg.web
        self.pool = BrokerPool(cfg.broker.url)
        self.redactor = Redactor(cfg.web.redact)
        self.sampler = Sampler(self.pool, cfg.broker.queues, interval=sample_interval)
        self.logins = LoginThrottle()  # failed logins per client address
        self.sessions = auth.Sessions(SESSION_AGE)  # logged in, not logged out
        # argon2 is slow on purpose (~0.1-0.3 s): on the event loop, every login would stall
        # every page, API answer and live stream. One thread: logins queue, nothing else waits.
        self.hashing = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tangguh-web-argon2")
        self.templates = Jinja2Templates(directory=os.path.join(HERE, "templates"))
        self.templates.env.filters.update(when=when, ago=ago, duration=duration, pretty=pretty)
        self.templates.env.globals.update(nav=NAV, finished=FINISHED)

    def fetch(self):
        return Fetch(self.pool)

    async def check_password(self, name, password):
        return await asyncio.get_running_loop().run_in_executor(self.hashing, auth.check_password, self.web, name,
                                                                password)

    def render(self, request, name, status=200, problems=(), **context):
        # An outage the sampler saw shows on every page, even one whose own reads did not fail.
        problems = list(problems) + [p for p in self.sampler.snapshot["problems"]
                                     if p.startswith("The broker is unreachable") and p not in problems]
        context.update(request=request, me=request.state.identity, csrf=csrf.token(request),
                       problems=problems, path=request.url.path, flash=request.session.pop("flash", None))
        return self.templates.TemplateResponse(request, name, context, status_code=status)

    def audit(self, identity, action, count, job_ids=None, filter=None, **extra):
        """One JSON event per action: who, what, which jobs or filter, how many."""
        fields = {"event": "web_action", "user": identity.name, "action": action, "count": count}
        if job_ids is not None:
            fields["job_ids"] = list(job_ids)[:100]  # the first hundred: a bulk action's line stays readable
        if filter is not None:
            fields["filter"] = filter
        fields.update(extra)
        log.info("%s by %s: %d job(s)", action, identity.name, count, extra=fields)


def gate(kind="page", admin=False):
    """``kind``: "page" (HTML) or "api" (JSON). ``admin``: the endpoint changes something."""
    def wrap(endpoint):
        @functools.wraps(endpoint)
        async def run(request):
            console = request.app.state.console
            identity = request.state.identity = auth.identify(request, console.web, console.sessions)
            if identity is None:
                if kind == "api":
                    return JSONResponse({"error": "authentication required"}, status_code=401)
                return RedirectResponse("/login?next=" + quote(back_after_login(request), safe="/"), status_code=303)
            form = None
            if request.method == "POST":
                if not identity.admin:
                    return refuse(console, request, kind, 403, "viewers cannot change anything")
                try:
                    if kind == "page":
                        form = await read_form(request)
                    else:  # the API's CSRF token comes in its header
                        request.state.body = await read_json(request)
                except BodyRefused as exc:
                    return refuse(console, request, kind, exc.status, str(exc))
                if not csrf.valid(request, identity, form):
                    return refuse(console, request, kind, 403, "missing or wrong CSRF token (reload the page)")
            try:
                return await (endpoint(request, form) if request.method == "POST" else endpoint(request))
            except BadInput as exc:
                return refuse(console, request, kind, 400, str(exc))
            except BrokerError as exc:
                return refuse(console, request, kind, 503, unreachable(exc))
            except NotImplementedError:
                return refuse(console, request, kind, 501, unsupported("this operation"))
        return run
    return wrap


def back_after_login(request):
    """Where the login page sends the browser: the page asked for, its filter too (a link from an
    alert to /jobs?state=dead&queue=billing). A form posted after the session ended goes back to
    the page the form was on, not to its action, which answers POST only."""
    if request.method != "GET":
        referer = urlsplit(request.headers.get("referer", ""))
        if referer.netloc != request.headers.get("host") or not referer.path.startswith("/"):
            return "/"
        return referer.path + ("?" + referer.query if referer.query else "")
    return request.url.path + ("?" + request.url.query if request.url.query else "")


def refuse(console, request, kind, status, message):
    if kind == "api":
        return JSONResponse({"error": message}, status_code=status)
    if getattr(request.state, "identity", None) is None:
        request.state.identity = auth.Identity("-", "viewer", "none")
    return console.render(request, "error.html", status=status, message=message, code=status)


# -- template filters ---------------------------------------------------------------

def when(ts):
    if ts is None:
        return "-"
    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def ago(ts, now=None):
    if ts is None:
        return "-"
    return duration((now or time.time()) - ts) + " ago"


def duration(seconds):
    if seconds is None:
        return "-"
    seconds = max(0.0, float(seconds))
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 90:
        return f"{seconds:.1f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


def pretty(value):
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False, default=str)
