"""An open console answers only loopback clients, addressing it by a loopback name.

With no users and no tokens every request acts as an admin, which ``tangguh web``
allows on a loopback address only. That alone does not keep other sites out: a
page whose DNS name an attacker re-points to 127.0.0.1 (DNS rebinding) is then
the console's own origin in the victim's browser, and could read its pages and
post its forms, CSRF token and all. Its requests still name the attacker's host,
so an open console refuses every ``Host`` that is not a loopback name or address.

Nor does the listen address keep other machines out when a reverse proxy on this
machine forwards to it: every request then comes from 127.0.0.1, and ``Host`` is
whatever the remote client sent. So the client's address must be loopback too
(uvicorn has already replaced the proxy's with the forwarded one), and a request
carrying any forwarding header is refused outright: a proxy in front means
remote users, who need ``[web.users]``.

A console with users or tokens needs none of this: the browser never sends its
session cookie to another host name, and every request proves who it is.
"""
from starlette.responses import PlainTextResponse

from .auth import is_loopback

FORWARDING = (b"x-forwarded-for", b"forwarded", b"x-real-ip", b"x-forwarded-host")


def loopback(host_header):
    """Whether a ``Host`` header (with or without a port, IPv6 in brackets) names this machine."""
    host = host_header.strip().lower()
    if host.startswith("["):
        host = host[1:].partition("]")[0]
    elif host.count(":") == 1:
        host = host.partition(":")[0]
    return is_loopback(host)


def refusal(scope):
    """Why an open console turns this request away (status, one line), or None."""
    headers = dict(scope["headers"])
    if not loopback(headers.get(b"host", b"").decode("latin-1")):
        return 400, "this console answers requests to a loopback address only"
    forwarded = [name.decode() for name in FORWARDING if name in headers]
    if forwarded:
        return 403, f"this console has no users, so it serves no one through a proxy ({forwarded[0]} sent)"
    client = scope.get("client")
    if not client or not is_loopback(str(client[0])):
        return 403, "this console has no users, so it serves clients on this machine only"
    return None


class LoopbackHostsOnly:
    """Plain ASGI middleware: a request refused here gets a 4xx and reaches nothing else."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            refused = refusal(scope)
            if refused:
                status, why = refused
                response = PlainTextResponse(why + " (see [web] users in the docs)\n", status_code=status)
                return await response(scope, receive, send)
        return await self.app(scope, receive, send)
