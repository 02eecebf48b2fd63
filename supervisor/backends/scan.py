"""Search and count by a ``JobFilter``, shared by every broker: the keyset walk and the bounded scan.

A broker gives ``search_jobs`` one function, ``fetch(after, n)``: up to ``n``
candidate rows past the key ``after`` (``(queued_at, id)``, None: from the
start) in the page's order, narrowed by whatever the broker's indexes serve.
Filters no index serves (``post``: payload fields on SQLite, error text on
both SQL brokers, all but queue and time on Redis) are checked here, row by
row, on at most ``SCAN_BOUND`` rows per call: a search never reads the whole
broker. When the bound is reached first the page comes back short (possibly
empty) with a ``next_cursor`` that continues the walk where it stopped.
"""
from .. import jobfilter
from ..errors import BadInput
from ..jobfilter import SCHEDULED, Count, Page, check_page, decode_cursor, encode_cursor, matches_payload
from ..model import load_json

SCAN_BOUND = 5000  # rows checked row by row per search or count call
_BATCH = 500

# Which states carry an error a search by error text looks at.
ERROR_STATES = ("dead", "retrying")


def start(filter, cursor, limit, order):
    """Check the arguments (BadInput otherwise); the key after which the page starts, or None."""
    if not isinstance(filter, jobfilter.JobFilter):
        filter = jobfilter.JobFilter.from_dict(filter)
    check_page(limit, order)
    after = None if cursor is None else decode_cursor(cursor, order)
    return filter, after


def matches(f, row, post):
    """Whether a candidate row (a dict of the job's columns) passes the ``post`` filters of ``f``."""
    for name in post:
        if name == "payload":
            if "payload_ok" in row:  # the broker compared the fields itself (SQLite's JSON functions)
                if not row["payload_ok"]:
                    return False
                continue
            payload = row.get("payload")
            if isinstance(payload, (str, bytes)):
                payload = load_json(payload)
            if not isinstance(payload, dict) or not matches_payload(payload, f.payload):
                return False
        elif name == "error":
            if row.get("state") not in ERROR_STATES or not error_matches(row.get("error"), f.error):
                return False
        elif name == "state":
            # "later": the broker's verdict on run_at against its clock (a queued or retrying job due later)
            if row.get("state") not in f.state and not (SCHEDULED in f.state and row.get("later")):
                return False
        elif name in ("queued_after", "finished_after"):
            value = _number(row.get(name.split("_")[0] + "_at"))
            if value is None or value < getattr(f, name):
                return False
        elif name in ("queued_before", "finished_before"):
            value = _number(row.get(name.split("_")[0] + "_at"))
            if value is None or value >= getattr(f, name):
                return False
        elif row.get(name) != getattr(f, name):
            return False
    return True


def error_matches(error, text):
    """``text`` in the error's message or class, ignoring case."""
    if isinstance(error, (str, bytes)):
        error = load_json(error)
    if not isinstance(error, dict):
        return False
    needle = text.lower()
    return any(needle in str(error.get(k) or "").lower() for k in ("message", "class"))


def _number(value):
    try:
        return None if value in (None, "") else float(value)
    except (TypeError, ValueError):
        return None


def post_names(f, served):
    """The filters of ``f`` that are set and not in ``served`` (what the broker's indexes serve)."""
    return [name for name in f.to_dict() if name not in served]


def search_jobs(fetch, load, f, after, limit, order, post):
    """A ``Page``: rows from ``fetch`` that pass ``post``, loaded as jobs by ``load(ids)`` (in order).

    Without ``post`` filters one fetch of ``limit + 1`` rows decides the page.
    With them, rows are checked in batches until the page is full and one more
    match is seen (so the last page has no cursor), or ``SCAN_BOUND`` rows
    were checked: then the cursor points at the last row checked.
    """
    if not post:
        rows = fetch(after, limit + 1)
        more = len(rows) > limit
        rows = rows[:limit]
        cursor = encode_cursor(order, rows[-1]["queued_at"], rows[-1]["id"]) if more and rows else None
        return Page(load([r["id"] for r in rows]), cursor)
    picked, examined, last, cursor = [], 0, after, None
    while examined < SCAN_BOUND:
        want = min(_BATCH, SCAN_BOUND - examined)
        rows = fetch(last, want)
        for row in rows:
            examined += 1
            if matches(f, row, post):
                if len(picked) == limit:  # one match past the page: there is a next page
                    tail = picked[-1]
                    cursor = encode_cursor(order, tail["queued_at"], tail["id"])
                    return Page(load([r["id"] for r in picked]), cursor)
                picked.append(row)
            last = (float(row["queued_at"]), row["id"])
        if len(rows) < want:
            return Page(load([r["id"] for r in picked]), None)  # walked to the end
    if len(picked) == limit:
        tail = picked[-1]
        last = (float(tail["queued_at"]), tail["id"])
    cursor = encode_cursor(order, last[0], last[1]) if last is not None else None
    return Page(load([r["id"] for r in picked]), cursor)


def count_jobs(fetch, indexed_count, estimate, f, exact_up_to, post):
    """A ``Count``: exact while at most ``exact_up_to`` jobs match and the scan is complete.

    ``indexed_count(cap)`` counts what the indexes select, stopping past
    ``cap``; ``estimate()`` is the broker's guess of that number without
    counting (the planner's, an index count...). Past the threshold, or when
    ``post`` filters would need more than ``SCAN_BOUND`` rows checked, the
    number is the estimate times the share of checked rows that matched.
    """
    if isinstance(exact_up_to, bool) or not isinstance(exact_up_to, int) or exact_up_to < 0:
        raise BadInput(f"exact_up_to must be an integer >= 0, got {exact_up_to!r}")
    if not post:
        n = indexed_count(exact_up_to + 1)
        if n <= exact_up_to:
            return Count(n, True)
        return Count(max(int(estimate()), exact_up_to + 1), False)
    matched, examined, last = 0, 0, None
    while examined < SCAN_BOUND:
        want = min(_BATCH, SCAN_BOUND - examined)
        rows = fetch(last, want)
        for row in rows:
            examined += 1
            matched += matches(f, row, post)
            last = (float(row["queued_at"]), row["id"])
        if len(rows) < want:
            if matched <= exact_up_to:
                return Count(matched, True)
            break
    share = matched / examined if examined else 0.0
    return Count(max(matched, int(estimate() * share)), False)
