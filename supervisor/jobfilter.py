"""What ``search``, ``count`` and the bulk actions select: one filter for every broker.

A ``JobFilter`` is built from keyword arguments (the API), from a dict (the JSON
API, the web console) or from command-line options (``--where payload.a.b=7``).
Every way in validates the same: an unknown key, a bad state, a malformed
``where`` or time range raises BadInput naming it, and nothing is searched.
"""
import base64
import dataclasses
import json
import math

from .errors import BadInput
from .jsonvalues import is_storable
from .model import STATES, check_queue

# Not a state of its own but the part of two that ``stats`` counts apart: queued or retrying
# jobs due later (delayed, or waiting out a retry backoff), by the broker's clock. A filter
# names it beside the states.
SCHEDULED = "scheduled"
DUE_LATER = ("queued", "retrying")
FILTER_STATES = STATES + (SCHEDULED,)
# What the other counts shown beside them (stats, queues, the console) select.
_COUNTS = {"ready": "of the queued and retrying jobs that are due (queued and retrying, less scheduled)",
           "in_flight": "of state running", "in-flight": "of state running"}
ORDERS = ("newest", "oldest")
MAX_LIMIT = 1000
MAX_PAYLOAD_FIELDS = 32  # payload fields a filter compares
_PAYLOAD_KEY_PART = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


@dataclasses.dataclass(frozen=True)
class JobFilter:
    """Every field narrows the selection; an empty filter selects every job.

    ``payload`` maps a dotted key (``"order_id"``, ``"customer.id"``) to the
    value it must equal (a string, number, bool or None). ``error`` is a
    substring of the last error's message or class (dead and retrying jobs).
    Times are broker-clock epoch seconds; ranges are ``[after, before)``.
    """

    state: tuple = ()
    queue: str | None = None
    type: str | None = None
    resource_id: str | None = None
    idempotency_key: str | None = None
    queued_after: float | None = None
    queued_before: float | None = None
    finished_after: float | None = None
    finished_before: float | None = None
    error: str | None = None
    payload: tuple = ()  # ((dotted key, value), ...), sorted: hashable and stable

    def __post_init__(self):
        if not isinstance(self.state, (str, list, tuple)) and self.state is not None:
            raise BadInput(f"state filter must be a state or a list of states, got {self.state!r}")
        state = (self.state,) if isinstance(self.state, str) else tuple(self.state or ())
        for s in state:
            if not isinstance(s, str) or s not in FILTER_STATES:
                hint = f"; the {s} count is {_COUNTS[s]}" if s in _COUNTS else ""
                raise BadInput(f"unknown state {s!r} (expected one of {', '.join(FILTER_STATES)}{hint})")
        if SCHEDULED in state and set(DUE_LATER) <= set(state):  # it selects nothing more: no OR arm for it
            state = tuple(s for s in state if s != SCHEDULED)
        object.__setattr__(self, "state", tuple(dict.fromkeys(state)))
        if self.queue is not None:
            check_queue(self.queue)
        for name in ("type", "resource_id", "idempotency_key", "error"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value or len(value) > 255
                                      or not is_storable(value)):
                raise BadInput(f"{name} filter must be 1 to 255 characters, no NUL or lone surrogate, got {value!r}")
        for name in ("queued_after", "queued_before", "finished_after", "finished_before"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value)):
                raise BadInput(f"{name} must be a number of epoch seconds, got {value!r}")
        if isinstance(self.payload, dict):
            pairs = list(self.payload.items())
        elif isinstance(self.payload, (list, tuple)) and all(
                isinstance(pair, (list, tuple)) and len(pair) == 2 for pair in self.payload):
            pairs = self.payload
        else:
            raise BadInput(f"payload filter must map dotted keys to values, got {self.payload!r}")
        if len(pairs) > MAX_PAYLOAD_FIELDS:  # SQLite refuses an expression tree 1,000 deep
            raise BadInput(f"at most {MAX_PAYLOAD_FIELDS} payload fields in a filter, got {len(pairs)}")
        checked = []
        for key, value in pairs:
            check_payload_key(key)
            if not (value is None or isinstance(value, (bool, int)) or (isinstance(value, str) and is_storable(value))
                    or (isinstance(value, float) and math.isfinite(value))):
                raise BadInput(f"payload.{key} must equal a string (no NUL or lone surrogate), number, true, false"
                               f" or null, got {value!r}")
            checked.append((key, value))
        object.__setattr__(self, "payload", tuple(sorted(checked, key=lambda kv: kv[0])))

    @classmethod
    def from_dict(cls, d):
        """The filter a JSON object names; an unknown key is BadInput."""
        if not isinstance(d, dict):
            raise BadInput("a filter must be a JSON object")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise BadInput(f"unknown filter key {unknown[0]!r} (expected one of {', '.join(sorted(names))})")
        return cls(**d)

    def to_dict(self):
        d = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value not in (None, ()):
                d[f.name] = dict(value) if f.name == "payload" else list(value) if f.name == "state" else value
        return d

    def __bool__(self):
        return bool(self.to_dict())


def check_payload_key(key):
    parts = key.split(".") if isinstance(key, str) else [""]
    if not 0 < len(parts) <= 8 or any(not p or not set(p) <= _PAYLOAD_KEY_PART for p in parts):
        raise BadInput(f"payload key {key!r} must be dotted names of letters, digits, _ or - (up to 8 levels)")


def parse_where(text):
    """``"payload.order_id=7"`` -> ``("order_id", 7)``; the value is JSON when it parses, else a string."""
    key, sep, raw = text.partition("=") if isinstance(text, str) else ("", "", "")
    key = key.strip()
    if not sep or not key.startswith("payload.") or not raw:
        raise BadInput(f"--where expects payload.KEY=VALUE, got {text!r}")
    key = key[len("payload."):]
    check_payload_key(key)
    try:
        value = json.loads(raw)
    except ValueError:
        value = raw
    if isinstance(value, (list, dict)):
        raise BadInput(f"--where {key}: compare with a string, number, true, false or null, got {raw!r}")
    return key, value


def parse_wheres(texts, check=None):
    """``{key: value}`` of several ``parse_where`` texts, ``check(key)`` called on each. A key
    given twice is BadInput: the second value replaced the first, and a bulk action by that
    filter took the jobs of one value without a word about the other."""
    payload = {}
    for text in texts:
        key, value = parse_where(text)
        if key in payload:
            raise BadInput(f"payload.{key} given twice ({payload[key]!r} and {value!r}): a job's field has one value")
        if check is not None:
            check(key)
        payload[key] = value
    return payload


def payload_value(payload, dotted):
    """The value at a dotted key, or a sentinel that equals nothing."""
    node = payload
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


class _Missing:
    def __eq__(self, other):
        return False

    def __repr__(self):
        return "<missing>"


_MISSING = _Missing()


def matches_payload(payload, pairs):
    """True when every (dotted key, value) pair equals the payload's (a bool never equals a number)."""
    for key, want in pairs:
        have = payload_value(payload, key)
        if have is _MISSING or (type(have) is bool) != (type(want) is bool) or have != want:
            return False
    return True


def encode_cursor(order, sort_value, job_id):
    raw = json.dumps([order, sort_value, job_id], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor, order):
    """(sort value, job id) of a cursor made by ``encode_cursor`` for the same order; BadInput otherwise."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        got_order, sort_value, job_id = json.loads(raw)
        # Only what encode_cursor makes: a time (finite, not a bool) and an id a job can have.
        if (got_order != order or not isinstance(job_id, str) or not is_storable(job_id)
                or isinstance(sort_value, bool) or not isinstance(sort_value, (int, float))
                or not abs(sort_value) < 1e15):
            raise ValueError
        return sort_value, job_id
    except (ValueError, TypeError, UnicodeDecodeError, RecursionError):  # RecursionError: JSON nested deep
        raise BadInput("bad cursor (use the next_cursor of a page with the same order)") from None


def check_page(limit, order):
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
        raise BadInput(f"limit must be an integer from 1 to {MAX_LIMIT}, got {limit!r}")
    if order not in ORDERS:
        raise BadInput(f"order must be one of {', '.join(ORDERS)}, got {order!r}")


@dataclasses.dataclass
class Page:
    """One page of a search: the jobs, and the cursor of the next page (None: this was the last)."""

    jobs: list
    next_cursor: str | None = None


@dataclasses.dataclass(frozen=True)
class Count:
    """How many jobs a filter selects: exact, or an estimate (``exact=False``) where counting would scan."""

    n: int
    exact: bool = True
