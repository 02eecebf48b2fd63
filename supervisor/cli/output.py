"""How the commands print: JSON, escaped text, timestamps, durations, sizes, tables."""
import datetime
import json
import re

from .common import Failure


def print_json(data):
    try:
        text = json.dumps(data, indent=2, sort_keys=False, default=str)
    except RecursionError:  # the indenting encoder recurses in Python: deep data prints compact
        try:
            text = json.dumps(data, default=str)
        except RecursionError:
            raise Failure("too deeply nested to print as JSON") from None
    print(text)


# Control characters (C0, DEL, C1): a job's type or error could otherwise send
# escape sequences to the operator's terminal.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")


def printable(text, keep="\n"):
    """``text`` with every control character but those in ``keep`` shown escaped (``\\x1b``)."""
    return _CONTROL.sub(lambda m: m.group() if m.group() in keep else m.group().encode("unicode_escape").decode(),
                        str(text))


def say(text):
    """Print text output: every text printer goes through here."""
    print(printable(text))


def when(ts):
    """A timestamp as UTC ISO 8601, or '-'."""
    if ts is None:
        return "-"
    try:
        moment = datetime.datetime.fromtimestamp(ts, datetime.timezone.utc)
    except (OverflowError, OSError, ValueError):  # past year 9999: show the number
        return f"{ts!r} (epoch seconds)"
    except TypeError:  # not a number at all: a hand-edited record's, shown as it is
        return repr(ts)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def duration(seconds):
    """Seconds as a short human duration: 0.42s, 12.3s, 4m05s, 2h03m, 3d04h."""
    if seconds is None:
        return "-"
    s = float(seconds)
    if s < 10:
        return f"{s:.2f}s"
    if s < 60:
        return f"{s:.1f}s"
    s = int(s)
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def size(n):
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024


def table(headers, rows):
    """Rows of strings as aligned columns (numbers right-aligned)."""
    rows = [["-" if v is None else printable(v, keep="") for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    numeric = [all(_looks_numeric(r[i]) for r in rows) and rows for i in range(len(headers))]

    def line(cells, header=False):
        out = []
        for i, cell in enumerate(cells):
            right = numeric[i] and not header
            out.append(cell.rjust(widths[i]) if right else cell.ljust(widths[i]))
        return "  ".join(out).rstrip()

    return "\n".join([line(headers, True)] + [line(r) for r in rows])


def _looks_numeric(s):
    try:
        float(s)
        return True
    except ValueError:
        return False


def one_line(text, width=60):
    text = " ".join(str(text or "").split())
    return text if len(text) <= width else text[: width - 1] + "…"
