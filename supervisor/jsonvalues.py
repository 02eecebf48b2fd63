"""JSON values a job carries (payloads, results): the checks at enqueue, the decode on reading.

What one broker cannot store or hand to a worker is refused by all of them,
before anything is written (model.py's bounds).
"""
import json
import math
import re

from .errors import BadInput

MAX_DEPTH = 64  # nesting levels of a payload: far from any parser's recursion limit
# Characters no text column takes (PostgreSQL refuses NUL; UTF-8 has no lone surrogates).
UNSTORABLE = re.compile("[\x00\ud800-\udfff]")
# A handler's error text is stored in every attempt's history and logged on one
# line: a multi-megabyte exception message must not become megabytes per attempt.
MAX_ERROR_MESSAGE = 8 * 1024
MAX_ERROR_TRACEBACK = 32 * 1024
MAX_ERROR_CLASS = 255


def check_json(value, what):
    """Return ``value`` serialised as JSON, or raise BadInput naming ``what``.

    The nesting is measured first, without recursion: a value deeper than
    ``MAX_DEPTH`` (or cyclic) is refused whatever the caller's stack depth.
    """
    if json_depth(value) > MAX_DEPTH:
        raise BadInput(f"{what} is nested more than {MAX_DEPTH} levels deep")
    bad = _non_string_key(value)  # after the depth: a cyclic value never gets here
    if bad is not None:
        where, key = bad
        # Refused, not converted: JSON would store 1 as "1" (beside a "1" already there: one key, data lost).
        raise BadInput(f"{what}{where}: the key {_short(key)} is {type(key).__name__}, not a string"
                       f" (JSON object keys are strings)")
    try:
        text = _ENCODER.encode(value)
    except (TypeError, ValueError, RecursionError) as exc:
        raise BadInput(f"{what} must be JSON-serialisable: {exc}") from None
    # The encoder escapes them (ASCII output): only a text holding such an escape needs the walk.
    if ("\\u0000" in text or "\\ud" in text) and _holds_unstorable(value):
        raise BadInput(f"{what} contains a NUL character or a lone surrogate, which no broker stores")
    return text


def _non_string_key(value):
    """(path, key) of the first dict key in ``value`` that is not a string, or None."""
    if type(value) is dict and all(type(k) is str and not isinstance(v, (dict, list, tuple))
                                   for k, v in value.items()):
        return None  # the usual payload, a flat object with string keys: no walk
    stack = [(value, ())]
    while stack:
        item, path = stack.pop()
        if isinstance(item, dict):
            for k, v in item.items():
                if not isinstance(k, str):
                    return _path(path), k
                if isinstance(v, (dict, list, tuple)):
                    stack.append((v, (path, k)))
        elif isinstance(item, (list, tuple)):
            stack.extend((v, (path, i)) for i, v in enumerate(item) if isinstance(v, (dict, list, tuple)))
    return None


def _path(chain):
    """``.a[0].b`` from the walk's (parent, step) chain: how schema errors name a place too."""
    steps = []
    while chain:
        chain, step = chain
        steps.append(f"[{step}]" if isinstance(step, int) else f".{_short(step, quote=False)}")
    return "".join(reversed(steps))


def _short(key, quote=True):
    try:
        text = repr(key) if quote else str(key)
    except Exception:  # noqa: BLE001 - a key type whose repr fails
        text = f"<{type(key).__name__}>"
    return clip_start(text, 80)


def _holds_unstorable(value):
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if UNSTORABLE.search(v):
                return True
        elif isinstance(v, dict):
            stack.extend(v)
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return False


# json.dumps(value, allow_nan=False, separators=(",", ":")) without building an encoder per call.
_ENCODER = json.JSONEncoder(allow_nan=False, separators=(",", ":"))
_MEMBERS_ENCODER = json.JSONEncoder(separators=(",", ":"))
_DECODER = json.JSONDecoder()
_SCAN, _DECODE = _DECODER.scan_once, _DECODER.decode


def decode(text):
    """``json.loads`` of a str. A text that is one value with nothing around it (every text
    Tangguh writes: a child's reply, a stored payload) is read by the C scanner alone: the
    decoder's two whitespace matches and two Python frames were most of a small payload's
    decode (1.2 µs against 0.3). Any other text (space around the value, data after it, no
    JSON at all) goes through the decoder, which returns what ``json.loads`` returns or
    raises what it raises."""
    try:
        value, end = _SCAN(text, 0)
    except StopIteration:
        return _DECODE(text)
    return value if end == len(text) else _DECODE(text)


def json_depth(value, stop=MAX_DEPTH):
    """Levels of lists and dicts in ``value`` (0 for a scalar), counted up to ``stop + 1``."""
    if type(value) is dict:  # the usual payload, a flat object: no walk
        for child in value.values():
            if isinstance(child, (dict, list, tuple)):
                break
        else:
            return 1
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        if deepest > stop:
            return deepest
        stack.extend((child, depth + 1) for child in children)
    return deepest


def result_json(result):
    """A handler's result as the JSON text an ack stores: most handlers return nothing,
    and ``null`` needs no ``json.dumps`` (which builds an encoder every call)."""
    return "null" if result is None else json.dumps(result)


def info_members(info):
    """The inside of ``info``'s JSON object ('' when empty), as compact ``json.dumps`` writes it.

    ``info`` is an attempt's info (the master's ``attempt_info``: host, pid, slot, duration),
    stored with every outcome: once per job in the master's process. That shape is written
    with one format instead of ``json.dumps``, which builds an encoder every call (three
    quarters of its time on so small an object); any other goes through the encoder."""
    if not info:
        return ""
    if len(info) == 4:
        host, pid, slot, duration = (info.get("host"), info.get("pid"), info.get("slot"),
                                     info.get("duration"))
        if type(pid) is int and type(slot) is int and type(duration) is float and math.isfinite(duration):
            host_text = _plain_text(host)
            if host_text is not None:
                return f'"host":{host_text},"pid":{pid},"slot":{slot},"duration":{duration!r}'
    return _MEMBERS_ENCODER.encode(info)[1:-1]


def info_json(info):
    """``info`` as a JSON object (``{}`` when empty or None)."""
    return "{" + info_members(info) + "}"


def entry_json(info, ended_at, outcome):
    """A history entry's closing part: ``info`` with ``ended_at`` (seconds) and ``outcome``."""
    if info and ("ended_at" in info or "outcome" in info):
        return json.dumps(dict(info, ended_at=ended_at, outcome=outcome))  # theirs give way, as dict() would
    members = info_members(info)  # ended_at: a clock's reading, finite
    # A str is encoded without an encoder object (JSONEncoder.encode's own shortcut).
    return (f'{{{members}{"," if members else ""}"ended_at":{float(ended_at)!r},'
            f'"outcome":{json.dumps(outcome)}}}')


_last_host = (None, None)  # the last host written and its JSON (one tuple: threads read it whole)


def _plain_text(text):
    """``text`` as a JSON string when it needs no escape (a host name), else None."""
    global _last_host
    last = _last_host
    if text is last[0]:
        return last[1]
    if type(text) is not str or not (text.isascii() and text.isprintable()) or '"' in text or "\\" in text:
        return None
    _last_host = last = (text, f'"{text}"')
    return last[1]


def load_json(text):
    """Decode a stored JSON value; text that does not decode (invalid, or too deep for
    the parser) comes back as the text itself, so reading a job never raises.

    Twice a claimed job on PostgreSQL (payload, history: psycopg hands over bytes) and once on
    Redis: the decoder itself, without ``json.loads``' type checks and its guess of a byte
    string's encoding (stored JSON is UTF-8: half the time of a small value's decode)."""
    try:
        return decode(text.decode() if isinstance(text, (bytes, bytearray)) else text)
    except (ValueError, RecursionError):
        return text.decode("utf-8", "replace") if isinstance(text, (bytes, bytearray)) else text


def payload_problem(payload):
    """Why a stored payload cannot be handed to a worker, or None."""
    if not isinstance(payload, dict):
        return "the stored payload is not a JSON object (or does not decode)"
    if json_depth(payload) > MAX_DEPTH:
        return f"the stored payload is nested more than {MAX_DEPTH} levels deep"
    return None


def clip_start(text, limit):
    """``text`` cut to its first ``limit`` characters, saying how many were cut (a message reads from its start)."""
    if not isinstance(text, str) or len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text) - limit} characters cut)"


def clip_end(text, limit):
    """``text`` cut to its last ``limit`` characters, saying how many were cut (a traceback ends where it failed)."""
    if not isinstance(text, str) or len(text) <= limit:
        return text
    return f"({len(text) - limit} characters cut) …{text[-limit:]}"


def storable(text):
    """``text`` with what no database text column takes (NUL, lone surrogates) replaced by U+FFFD."""
    return UNSTORABLE.sub("\ufffd", text) if isinstance(text, str) else text


def is_storable(text):
    """False when ``text`` holds what ``storable`` would replace."""
    return not UNSTORABLE.search(text)
