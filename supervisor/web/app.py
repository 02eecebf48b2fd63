"""The console's wiring: routes, middleware, the sampler's life, and error pages without tracebacks.

``build(cfg)`` returns the ASGI app; ``serve(cfg, listen)`` runs it under
uvicorn. The session cookie is signed with a key made at start, so a restart
logs everybody out (nothing secret is ever written to disk).
"""
import asyncio
import contextlib
import logging
import os
import secrets

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.sessions import SessionMiddleware
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from ..model import FINISHED
from . import actions, api, auth, live, pages
from .console import HERE, SESSION_AGE, Console, gate, pretty, when
from .headers import HEADERS, SecurityHeaders
from .hosts import LoopbackHostsOnly

log = logging.getLogger("tangguh.web")
MAX_CONNECTIONS = 200


async def while_logged_in(request, stream):
    """The stream's events while its session lasts: the gate let it in once, and a stream stays open
    for hours, past a logout (a copy of the cookie too) or the session's end. Nothing is sent after."""
    c = request.app.state.console
    try:
        async for chunk in stream:
            if auth.identify(request, c.web, c.sessions) is None:
                return
            yield chunk
    finally:
        await stream.aclose()


@gate()
async def overview_events(request):
    c = request.app.state.console
    stream = live.overview_stream(request, c.sampler)
    return StreamingResponse(while_logged_in(request, stream), media_type="text/event-stream")


@gate()
async def job_events(request):
    c = request.app.state.console
    stream = live.job_stream(request, c.pool, c.redactor, request.path_params["job_id"], FINISHED, when, pretty)
    return StreamingResponse(while_logged_in(request, stream), media_type="text/event-stream")


def routes():
    get, post = ["GET"], ["POST"]
    return [
        Route("/", pages.overview, methods=get),
        Route("/jobs", pages.jobs, methods=get),
        Route("/jobs/bulk", actions.jobs_bulk, methods=post),
        # A job id the caller chose may hold any character: the links percent-encode it, a "/" in it stays one.
        Route("/jobs/{job_id:path}/{action}", actions.job_post, methods=post),
        Route("/jobs/{job_id:path}", pages.job, methods=get),
        Route("/dead", pages.dead, methods=get),
        Route("/dead/{action}", actions.dead_post, methods=post),
        Route("/queues", pages.queues, methods=get),
        Route("/queues/{action}", actions.queue_post, methods=post),
        Route("/schedules", pages.schedules, methods=get),
        # Any TOML key is a schedule name: the link percent-encodes it, and a "/" in it stays one.
        Route("/schedules/{name:path}/run", actions.schedule_post, methods=post),
        Route("/supervisors", pages.supervisors, methods=get),
        Route("/login", pages.login_form, methods=get),
        Route("/login", pages.login, methods=post),
        Route("/logout", pages.logout, methods=post),
        Route("/events/overview", overview_events, methods=get),
        Route("/events/jobs/{job_id:path}", job_events, methods=get),
        Route("/api/overview", api.overview, methods=get),
        Route("/api/jobs", api.jobs, methods=get),
        Route("/api/jobs/count", api.count, methods=get),
        Route("/api/jobs/{action}", api.jobs_action, methods=post),
        Route("/api/jobs/{job_id:path}/{action}", api.job_action, methods=post),
        Route("/api/jobs/{job_id:path}", api.job, methods=get),
        Route("/api/dead", api.dead, methods=get),
        Route("/api/dead/{action}", api.dead_action, methods=post),
        Route("/api/queues", api.queues, methods=get),
        Route("/api/queues/{action}", api.queue_action, methods=post),
        Route("/api/queues/{queue}/{action}", api.queue_action, methods=post),
        Route("/api/schedules", api.schedules, methods=get),
        Route("/api/supervisors", api.supervisors, methods=get),
        Mount("/static", StaticFiles(directory=os.path.join(HERE, "static")), name="static"),
    ]


def build(cfg, sample_interval=1.0):
    console = Console(cfg, sample_interval)
    console.tasks = actions.Tasks()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        sampler = asyncio.get_running_loop().create_task(console.sampler.run())
        try:
            yield
        finally:
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
            console.pool.close()
            console.hashing.shutdown(wait=False)

    app = Starlette(
        routes=routes(), lifespan=lifespan,
        middleware=[Middleware(SecurityHeaders),
                    # An open console turns away requests to other hosts (DNS rebinding) or from other machines first.
                    *([] if auth.auth_configured(cfg.web) else [Middleware(LoopbackHostsOnly)]),
                    Middleware(SessionMiddleware, secret_key=secrets.token_urlsafe(32), session_cookie="tangguh_web",
                               same_site="strict", https_only=False, max_age=SESSION_AGE)],
        exception_handlers={HTTPException: http_error, Exception: internal_error})
    app.state.console = console
    return app


async def http_error(request, exc):
    return error_page(request, exc.status_code, "no such page" if exc.status_code == 404 else str(exc.detail))


async def internal_error(request, exc):
    # Logged with its traceback for the operator; the browser gets one line.
    log.error("console error on %s %s", request.method, request.url.path, exc_info=exc,
              extra={"event": "web_error"})
    response = error_page(request, 500, "internal error (the console's log has the details)")
    # Starlette answers from here outside the middleware: SecurityHeaders never sees this answer.
    response.headers.update({name.decode(): value.decode() for name, value in HEADERS})
    return response


def error_page(request, status, message):
    console = request.app.state.console
    if request.url.path.startswith("/api/"):
        return JSONResponse({"error": message}, status_code=status)
    request.state.identity = getattr(request.state, "identity", None) or auth.identify(request, console.web, console.sessions)
    return console.render(request, "error.html", status=status, code=status, message=message)


def bind(listen):
    """The console's socket, bound before anything is served or logged: a busy address is then
    the caller's one error line (uvicorn logged it among its start-up lines and exited 3). OSError."""
    import socket

    host, port = auth.split_listen(listen)
    family, kind, proto, _, address = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart need not wait TIME_WAIT
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def serve(cfg, sock):
    """Serve the console on ``bind``'s socket until stopped; False if it did not start."""
    import uvicorn

    # The console's own log lines (actions, errors) go through the root logger set up by the CLI.
    # limit_concurrency: open connections (live streams included) are bounded; past it uvicorn answers 503.
    # Bounded: no connection holds a slot without a request, nor another machine more than its share.
    from .connections import Bounded

    # proxy_headers: behind a proxy the throttle counts each browser's address, not the proxy's; without
    # one, trusting the header would let any local process name a new address for every guess.
    server = uvicorn.Server(uvicorn.Config(
        build(cfg), log_config=None, access_log=False, proxy_headers=cfg.web.behind_proxy,
        forwarded_allow_ips="127.0.0.1", timeout_graceful_shutdown=2, server_header=False,
        limit_concurrency=MAX_CONNECTIONS, http=Bounded))
    server.run(sockets=[sock])
    return server.started
