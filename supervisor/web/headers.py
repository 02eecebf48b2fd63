"""The headers every answer carries: no inline script, no framing, no sniffing;
and over HTTPS (a TLS proxy on 127.0.0.1 says so with ``X-Forwarded-Proto``) a
session cookie the browser never sends over plain HTTP."""

CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self';"
       " frame-ancestors 'none'; base-uri 'none'; form-action 'self'; object-src 'none'")

HEADERS = [
    (b"content-security-policy", CSP.encode()),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"same-origin"),
    (b"cache-control", b"no-store"),
]


class SecurityHeaders:
    """Plain ASGI middleware (it leaves streaming answers, the live updates, alone)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        https = scope.get("scheme") == "https"

        async def send_with_headers(message):
            if message["type"] == "http.response.start":
                names = {name for name, _ in HEADERS}
                message["headers"] = [secure(h) if https else h for h in message.get("headers", [])
                                      if h[0] not in names] + HEADERS
            await send(message)

        await self.app(scope, receive, send_with_headers)


def secure(header):
    """A ``Set-Cookie`` header with the ``Secure`` attribute (others as they are)."""
    name, value = header
    if name.lower() == b"set-cookie" and b"; secure" not in value.lower():
        return name, value + b"; secure"
    return header
