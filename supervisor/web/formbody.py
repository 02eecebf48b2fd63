"""The body of an HTML form route (urlencoded) or an API call (JSON): size-capped, read before anything is parsed.

The forms the pages post are ``application/x-www-form-urlencoded``; nothing else
is accepted there (415; JSON goes to ``/api/``). Starlette's own parser would take
multipart too, spooling an upload of any size to disk before the route could
refuse it (``/login`` does so before anyone has logged in), and hand the route a
file where it expects a string. Here the body is read up to a cap (413 past it)
and parsed as text, so every value is a string.
"""
from urllib.parse import parse_qsl

from starlette.datastructures import FormData

URLENCODED = "application/x-www-form-urlencoded"
LOGIN_LIMIT = 64 * 1024
# The bulk forms post up to BULK_CAP ids (about 40 bytes each, encoded) plus the filter.
FORM_LIMIT = 1024 * 1024
MAX_FIELDS = 20_000


class BodyRefused(Exception):
    def __init__(self, status, message):
        super().__init__(message)
        self.status = status


async def read_form(request, limit=FORM_LIMIT):
    """The posted form as FormData of strings; BodyRefused (415, 413 or 400) with one line why not."""
    kind = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if kind and kind != URLENCODED:
        raise BodyRefused(415, f"this form takes {URLENCODED} only, not {kind[:60]} (scripts: use /api/)")
    body = await _capped(request, limit, "the form")
    if body and not kind:
        raise BodyRefused(415, f"this form takes {URLENCODED} only (no Content-Type sent)")
    try:
        pairs = parse_qsl(body.decode("utf-8"), keep_blank_values=True, errors="strict", max_num_fields=MAX_FIELDS)
    except ValueError:  # UnicodeDecodeError included
        raise BodyRefused(400, "the form is not valid UTF-8 urlencoded text, or has too many fields") from None
    return FormData(pairs)


async def read_json(request, limit=FORM_LIMIT):
    """An API call's body as bytes, read up to the cap (BodyRefused 413 past it); the endpoint
    parses it as JSON whatever its Content-Type (``curl -d`` sends a form's), so a script that
    leaves the header out still works.

    Starlette's ``request.json()`` reads a body of any size, and a form posted to the API
    went through its multipart parser, an upload spooled to disk, before the endpoint refused it."""
    return bytes(await _capped(request, limit, "the body"))


async def _capped(request, limit, what):
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyRefused(413, f"{what} is over {limit // 1024} KiB")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:  # a chunked body declares no length
            raise BodyRefused(413, f"{what} is over {limit // 1024} KiB")
    return body
