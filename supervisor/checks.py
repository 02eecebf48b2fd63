"""Value checks for the config and the ``@job`` decorator.

Each returns the value (a number as float where it is a float setting) or
raises ValueError saying what was expected; the config names the key path in
front of it (``broker.lease_seconds: expected a positive number, got "abc"``).
"""
import math
import re
import urllib.parse

from .model import MAX_DELAY, MAX_INT, MAX_TIMEOUT, QUEUE_NAME, QUEUE_RULE


def _num(v):
    try:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    except OverflowError:  # an integer too large for a float (TOML has no size limit)
        return False


# Counts fit a 32-bit column, as an enqueue's max_attempts must: 10**30 jobs prefetched or running at
# once failed every claim (an integer SQLite and PostgreSQL cannot bind), the claims read as an outage.
def _count(v, low):
    return isinstance(v, int) and not isinstance(v, bool) and low <= v <= MAX_INT


def positive_int(v):
    if _count(v, 1):
        return v
    raise ValueError(f"expected a positive integer up to {MAX_INT}")


# Children per supervisor, from the config or SIGTTIN: each costs the master a descriptor
# and a process, and a count past this is a typo, not a machine.
MAX_WORKERS = 1024


def worker_count(v):
    if isinstance(v, int) and not isinstance(v, bool) and 0 < v <= MAX_WORKERS:
        return v
    raise ValueError(f"expected an integer from 1 to {MAX_WORKERS}")


def non_negative_int(v):
    if _count(v, 0):
        return v
    raise ValueError(f"expected an integer from 0 to {MAX_INT}")


def file_mode(v):
    """Permission bits: 600 written for 0o600 was taken modulo 0o1000 (--x-wx---)."""
    if isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 0o777:
        return v
    raise ValueError("expected a file mode from 0o000 to 0o777 (octal, as 0o660)")


def prefetch_setting(v):
    """``"auto"`` (per job type, from its run times) or a fixed count >= 0."""
    if v == "auto" or _count(v, 0):
        return v
    raise ValueError(f'expected "auto" or an integer from 0 to {MAX_INT}')


DAY = 86400.0


def seconds_up_to(most, said, zero=False):
    """Seconds above 0 (or 0 too, with ``zero``) and up to ``most``: a wait on 1e299 s overflowed (the
    heartbeat thread died on its Event.wait, a lease's time stamp was out of range)."""
    def check(v):
        if _num(v) and (v > 0 or (zero and v == 0)) and v <= most:
            return float(v) + 0.0  # -0.0 is 0
        raise ValueError(f"expected a number of seconds from 0 to {most:.0f} ({said})" if zero else
                         f"expected a positive number of seconds up to {most:.0f} ({said})")
    return check


up_to_a_day = seconds_up_to(DAY, "a day")
retention_seconds = seconds_up_to(MAX_DELAY, "ten years", zero=True)
up_to_ten_years = seconds_up_to(MAX_DELAY, "ten years")


def timeout_seconds(v):
    # What an enqueue's timeout may be: past it a soft timeout's timer overflowed (setitimer), and
    # every job of the type failed as an OverflowError before its handler ran.
    if _num(v) and 0 < v <= MAX_TIMEOUT:
        return float(v)
    raise ValueError(f"expected a positive number of seconds up to {MAX_TIMEOUT:.0f} (a year)")


def soft_timeout_seconds(v):
    if _num(v) and 0 <= v <= MAX_TIMEOUT:
        return float(v)
    raise ValueError(f"expected a number of seconds >= 0 and up to {MAX_TIMEOUT:.0f} (a year)")


def delay_seconds(v):
    # What an enqueue's delay or a RetryLater may be: a backoff past it put a retry off for ever.
    if _num(v) and 0 <= v <= MAX_DELAY:
        return float(v)
    raise ValueError(f"expected a number of seconds >= 0 and up to {MAX_DELAY:.0f} (ten years)")


def poll_interval(v):
    # Below this an idle master polls so often it spins a core (a microsecond: 16,000 empty claims a second).
    if _num(v) and 0.001 <= v <= 3600:
        return float(v)
    raise ValueError("expected a number of seconds >= 0.001 and up to 3600 (an hour)")


def fraction(v):
    if _num(v) and 0 <= v <= 1:
        return float(v)
    raise ValueError("expected a number between 0 and 1")


def string(v):
    if isinstance(v, str):
        return v
    raise ValueError("expected a string")


def name(v):
    if isinstance(v, str) and v.strip() and v == v.strip():
        return v
    raise ValueError("expected a non-empty name")


def names(v):
    if isinstance(v, list) and v and all(isinstance(x, str) and x.strip() for x in v) and len(set(v)) == len(v):
        return list(v)
    raise ValueError("expected a non-empty list of distinct names")


def queue_name(v):
    # The rule enqueue applies: a queue the config names must be one a producer can use.
    if isinstance(v, str) and QUEUE_NAME.fullmatch(v):
        return v
    raise ValueError(f"expected a queue name ({QUEUE_RULE})")


def queue_names(v):
    for q in names(v):
        if not QUEUE_NAME.fullmatch(q):
            raise ValueError(f"{q!r} is not a queue name ({QUEUE_RULE})")
    return list(v)


def group_name(v):
    # The portable POSIX/shadow-utils form: what `groupadd` accepts.
    if isinstance(v, str) and (v == "" or re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}", v)):
        return v
    raise ValueError("expected a group name such as \"tangguh-ops\" (or \"\" for none)")


def boolean(v):
    if isinstance(v, bool):
        return v
    raise ValueError("expected true or false")


def rate(v):
    from .model import parse_rate

    try:
        parse_rate(v)
    except ValueError as exc:
        raise ValueError(str(exc).split(", got ")[0]) from None  # the config's error names the value
    return v


# croniter's H (hashed) and R (random) values, in a field or one item of a list: R picks anew in
# every croniter built (a new minute each check, another on each supervisor), H needs a hash id.
_HASHED = re.compile(r"[hr](\(\d+-\d+\))?(/\d+)?", re.IGNORECASE)


def cron(v):
    import croniter

    if isinstance(v, str) and any(_HASHED.fullmatch(item) for field in v.split() for item in field.split(",")):
        raise ValueError("H and R (hashed and random values) are not supported: every supervisor must"
                         " compute the same ticks; write the values themselves")
    if isinstance(v, str) and croniter.croniter.is_valid(v):
        try:  # valid syntax that matches no date (Feb 31) failed every tick, read as a broker outage
            croniter.croniter(v).get_next()
        except croniter.CroniterBadDateError:
            raise ValueError(f'"{v}" matches no date') from None
        try:  # every check looks back for the latest tick: one with none before now (a year to come) cannot run
            croniter.croniter(v).get_prev()
        except croniter.CroniterBadDateError:
            raise ValueError("no tick before now (a year still to come?): a schedule needs a past tick to"
                             " look back to") from None
        return v
    raise ValueError('expected a cron expression ("*/5 * * * *"; a 6th field, last, is seconds)')


def timezone(v):
    import zoneinfo

    try:
        zoneinfo.ZoneInfo(v)
    except (TypeError, ValueError, zoneinfo.ZoneInfoNotFoundError):
        raise ValueError("expected an IANA time zone name (\"Europe/Berlin\", \"UTC\")") from None
    return v


def table(v):
    if isinstance(v, dict):
        return v
    raise ValueError("expected a table")


def one_of(*choices):
    def check(v):
        if v in choices:
            return v
        raise ValueError("expected one of " + ", ".join(repr(c) for c in choices))

    return check


def _scheme(url):
    try:
        return urllib.parse.urlsplit(url).scheme
    except ValueError:
        return ""


class Unshown(ValueError):
    """A bad value that must not be echoed (it may hold a password): the message says enough."""


def url_of(*schemes):
    def check(v):
        if isinstance(v, str) and (v == "" or _scheme(v) in schemes):
            return v
        expected = "expected an empty string or a " + " or ".join(f"{s}://" for s in schemes) + " URL"
        if not isinstance(v, str):
            raise ValueError(expected)
        raise Unshown(f"{expected}, got " + (f"scheme {_scheme(v)!r}" if _scheme(v) else "no URL"))

    return check


def listen_address(v):
    """``host:port`` for a listening socket (``[::1]:9465`` for IPv6)."""
    return _host_port(v, lowest=1)


def _host_port(v, lowest, any_host=False):
    if isinstance(v, str):
        host, colon, port = v.rpartition(":")
        # Brackets both or neither: "[::1:80" was read as ::1 port 80, the bracket dropped.
        bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        if colon and (bare or any_host) and not set("[]") & set(bare) and port.isdigit() and lowest <= int(port) < 65536:
            return v
    raise ValueError('expected "host:port", such as "127.0.0.1:9465"')


def metrics_listen(v):
    """``[metrics] listen``: empty (no endpoint) or ``host:port`` (``:port``: every address; port 0:
    one the system picks). A bad one passed ``config check``, and ``run`` served no metrics, an
    error in its log."""
    return _host_port(v, lowest=0, any_host=True) if string(v) else v


WEB_ROLES = ("admin", "viewer")


def web_accounts(secret_key):
    """``[web.users]`` / ``[web.tokens]``: name -> {``secret_key``: a hash, role: admin|viewer}.

    The hashes are not echoed in errors; a name that is not a plain word is refused,
    because it is printed in every action's log event.
    """
    def check(v):
        if not isinstance(v, dict):
            raise ValueError("expected a table of names")
        out = {}
        for account, entry in v.items():
            if not re.fullmatch(r"[A-Za-z0-9_.@-]{1,64}", account):
                raise Unshown(f"{account!r} is not a name (1 to 64 letters, digits or _ . @ -)")
            if not isinstance(entry, dict) or set(entry) - {secret_key, "role"}:
                raise Unshown(f"{account}: expected a table with {secret_key} and role")
            secret, role = entry.get(secret_key), entry.get("role", "viewer")
            if not isinstance(secret, str) or not secret:
                raise Unshown(f"{account}.{secret_key}: required ({_MAKE_SECRET[secret_key]})")
            if secret_key == "password" and not secret.startswith("$argon2"):
                raise Unshown(f"{account}.password: expected an argon2 hash ({_MAKE_SECRET[secret_key]}),"
                              " never the password itself")
            if secret_key == "sha256" and not re.fullmatch(r"[0-9a-f]{64}", secret):
                raise Unshown(f"{account}.sha256: expected 64 hex digits ({_MAKE_SECRET[secret_key]})")
            if role not in WEB_ROLES:
                raise Unshown(f"{account}.role: expected one of {', '.join(WEB_ROLES)}")
            out[account] = {secret_key: secret, "role": role}
        return out

    return check


_MAKE_SECRET = {"password": "made by `tangguh web hash-password`", "sha256": "made by `tangguh web new-token`"}


def field_names(v):
    if isinstance(v, list) and all(isinstance(x, str) and x.strip() for x in v):
        return list(v)
    raise ValueError("expected a list of field names")
