"""An open console answers only requests addressed to a loopback name.

With no users and no tokens every request acts as an admin, which ``tangguh web``
allows on a loopback address only. That alone does not keep other sites out: a
page whose DNS name an attacker re-points to 127.0.0.1 (DNS rebinding) is then
the console's own origin in the victim's browser, and could read its pages and
post its forms, CSRF token and all. Its requests still name the attacker's host,
so an open console refuses every ``Host`` that is not a loopback name or address.
A console with users or tokens needs no such rule: the browser never sends its
session cookie to another host name.
"""
from starlette.responses import PlainTextResponse

from .auth import is_loopback


def loopback(host_header):
    """Whether a ``Host`` header (with or without a port, IPv6 in brackets) names this machine."""
    host = host_header.strip().lower()
    if host.startswith("["):
        host = host[1:].partition("]")[0]
    elif host.count(":") == 1:
        host = host.partition(":")[0]
    return is_loopback(host)


class LoopbackHostsOnly:
    """Plain ASGI middleware: a request naming another host gets 400 and reaches nothing else."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            host = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
            if not loopback(host):
                response = PlainTextResponse("this console answers requests to a loopback address only"
                                             " (it has no users: see [web] in the docs)\n", status_code=400)
                return await response(scope, receive, send)
        return await self.app(scope, receive, send)
