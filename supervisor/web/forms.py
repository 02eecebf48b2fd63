"""The job filter from a form or query string, the way the Jobs page and the API take it.

``state`` (repeatable), ``queue``, ``type``, ``resource_id``, ``idempotency_key``,
``error``, ``since``/``until`` (queued time: ``15m``, ``2h``, ``7d`` ago, or an ISO
date-time in UTC) and ``where`` (one ``payload.KEY=VALUE`` per line, as the
command line's ``--where``). A bad value is BadInput naming the field; the page
shows it next to the form.
"""
import datetime
import re

from ..errors import BadInput
from ..jobfilter import JobFilter, parse_wheres

TEXT_FIELDS = ("queue", "type", "resource_id", "idempotency_key", "error")
FIELDS = ("state",) + TEXT_FIELDS + ("since", "until", "where")
_AGO = re.compile(r"(\d+(?:\.\d+)?)\s*([smhd])")
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def form_values(params):
    """The filter fields as strings (``state`` a list), from a Starlette QueryParams or FormData."""
    values = {name: (params.get(name) or "").strip() for name in FIELDS if name != "state"}
    values["state"] = [s for s in params.getlist("state") if s]
    return values


def parse_time(text, now, field):
    m = _AGO.fullmatch(text)
    if m:
        return now - float(m.group(1)) * _UNIT[m.group(2)]
    try:
        moment = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise BadInput(f"{field}: expected an age such as 15m, 2h, 7d or an ISO date-time, got {text!r}") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.timezone.utc)
    return moment.timestamp()


def job_filter(values, now, redactor):
    """A JobFilter from ``form_values``; BadInput names the field at fault."""
    kw = {name: values[name] for name in TEXT_FIELDS if values.get(name)}
    if values.get("state"):
        kw["state"] = tuple(values["state"])
    if values.get("since"):
        kw["queued_after"] = parse_time(values["since"], now, "since")
    if values.get("until"):
        kw["queued_before"] = parse_time(values["until"], now, "until")
    def searchable(key):
        if redactor.covers(key):
            # Matching on a masked field would tell its value one guess at a time.
            raise BadInput(f"where: payload.{key} is redacted and cannot be searched")

    lines = [line.strip() for line in (values.get("where") or "").splitlines() if line.strip()]
    payload = parse_wheres([line if line.startswith("payload.") else "payload." + line for line in lines], searchable)
    if payload:
        kw["payload"] = payload
    return JobFilter(**kw)


def query_string(values, **extra):
    """The filter as a query string (for the next page's link and the bulk form)."""
    from urllib.parse import urlencode

    pairs = [("state", s) for s in values.get("state", [])]
    pairs += [(k, values[k]) for k in FIELDS if k != "state" and values.get(k)]
    pairs += [(k, v) for k, v in extra.items() if v]
    return urlencode(pairs)
