"""Showing a connection URL without its secrets: one redactor for every message.

A password can hide in the userinfo (``redis://:pw@host``) or in a query
parameter (``postgresql://app@db/app?password=pw``, ``?sslpassword=``,
``?token=``...). ``redact`` masks both, and never raises: text it cannot take
apart is masked whole rather than shown.
"""
import re
import urllib.parse

MASK = "***"
# A query parameter whose name contains one of these holds a secret (case-insensitive).
SECRET_WORDS = ("pass", "pwd", "secret", "token", "auth", "credential", "apikey", "api_key")
# libpq's ``key=value`` form (and any text that is not a URL): mask the values of secret-looking keys.
_KEY_VALUE = re.compile(r"""(?i)\b([\w.-]*(?:%s)[\w.-]*)(\s*=\s*)('(?:[^'\\]|\\.)*'|[^\s&;]*)"""
                        % "|".join(map(re.escape, SECRET_WORDS)))


def is_secret(name):
    """Whether a parameter called ``name`` holds a secret."""
    name = name.lower()
    return any(word in name for word in SECRET_WORDS)


def redact(url):
    """``url`` with every password masked, for logs, errors and ``status``."""
    scheme = ""
    try:
        scheme, sep, rest = str(url).partition("://")
        if not sep or not re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*", scheme):
            return _KEY_VALUE.sub(rf"\1\2{MASK}", str(url))
        parts = urllib.parse.urlsplit(str(url))
        netloc = parts.netloc
        # The last "@" ends the userinfo: an unencoded "@" in a password comes before it.
        userinfo, at, host = netloc.rpartition("@")
        if "@" in rest[len(parts.netloc):]:
            # An unencoded "/", "?" or "#" in a password ends the netloc early and
            # the rest of the password lands in the path, query or fragment.
            raise ValueError("ambiguous userinfo")
        if at:
            user, colon, _password = userinfo.partition(":")
            netloc = f"{user}:{MASK}@{host}" if colon else netloc
        query = "&".join(_redact_pair(pair) for pair in parts.query.split("&")) if parts.query else ""
        fragment = _KEY_VALUE.sub(rf"\1\2{MASK}", parts.fragment)
        # Put together by hand: urlunsplit drops the "//" of an empty host (postgresql:///db).
        return (f"{scheme}://{netloc}{parts.path}" + (f"?{query}" if query else "")
                + (f"#{fragment}" if fragment else ""))
    except Exception:  # noqa: BLE001 - a message must never fail over the URL it shows
        return f"{scheme}://{MASK}" if re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*", scheme or "") else MASK


def _redact_pair(pair):
    key, eq, _value = pair.partition("=")
    return f"{key}={MASK}" if eq and is_secret(urllib.parse.unquote_plus(key)) else pair


def problem(url):
    """Why a server URL can never be read as meant, in words that show none of it; None when it can.

    A URL the parser refuses (``redis://[::1:6379``) would read as an outage for ever; an
    unencoded ``/``, ``?`` or ``#`` in a password ends the host part early, so the rest of
    the password is read as a host, option or path, and drivers echo those in their errors.
    A ``sqlite:`` path may hold any of these: only server URLs are checked.
    """
    text = str(url)
    scheme, sep, rest = text.partition("://")
    if not sep or scheme.lower() == "sqlite":
        return None
    try:
        parts = urllib.parse.urlsplit(text)
    except ValueError as exc:
        return f"cannot be read as a URL ({exc})"
    if "@" in rest[len(parts.netloc):] or parts.netloc.count("@") > 1:  # libpq reads up to the first "@"
        return ("the user name or password holds an unencoded '@', '/', '?' or '#':"
                " percent-encode it (%40, %2F, %3F, %23)")
    return None
