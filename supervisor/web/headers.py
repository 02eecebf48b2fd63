"""The headers every answer carries: no inline script, no framing, no sniffing."""

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

        async def send_with_headers(message):
            if message["type"] == "http.response.start":
                names = {name for name, _ in HEADERS}
                message["headers"] = [h for h in message.get("headers", []) if h[0] not in names] + HEADERS
            await send(message)

        await self.app(scope, receive, send_with_headers)
