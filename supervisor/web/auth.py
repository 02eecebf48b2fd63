"""Who is asking, and what they may do.

Browsers log in with a name and password (``[web.users]``, argon2 hashes made by
``tangguh web hash-password``) and then carry a signed session cookie; scripts
send ``Authorization: Bearer TOKEN`` (``[web.tokens]``, stored as SHA-256: a
token is long and random, so a fast hash is enough and a request costs no
argon2 round). With neither configured the console is open, which ``tangguh web``
allows on a loopback address only.
"""
import dataclasses
import hashlib
import hmac
import ipaddress
import secrets
import time

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError

_hasher = PasswordHasher()
# Checked when the name is unknown, so a wrong name costs the time a wrong password does.
_DUMMY = _hasher.hash(secrets.token_hex(16))


@dataclasses.dataclass(frozen=True)
class Identity:
    name: str
    role: str  # "admin" or "viewer"
    via: str  # "session", "token" or "open" (no auth configured, loopback only)

    @property
    def admin(self):
        return self.role == "admin"


def hash_password(password):
    return _hasher.hash(password)


def new_token():
    """A bearer token and the SHA-256 the config stores."""
    token = secrets.token_urlsafe(32)
    return token, token_digest(token)


def token_digest(token):
    return hashlib.sha256(token.encode()).hexdigest()


def auth_configured(web):
    return bool(web.users or web.tokens)


def check_password(web, name, password):
    """The user's Identity when ``password`` is theirs, else None."""
    entry = web.users.get(name) if isinstance(name, str) else None
    try:
        _hasher.verify(entry["password"] if entry else _DUMMY, password or "")
    except (VerificationError, InvalidHashError):
        return None
    return Identity(name, entry["role"], "session") if entry else None


def identify(request, web, sessions):
    """The Identity behind a request, or None (not logged in, or a bad token)."""
    if not auth_configured(web):
        return Identity("anonymous", "admin", "open")
    header = request.headers.get("authorization", "")
    if header[:7].lower() == "bearer ":
        digest = token_digest(header[7:].strip())
        for name, entry in web.tokens.items():
            if hmac.compare_digest(digest, entry["sha256"]):
                return Identity(name, entry["role"], "token")
        return None
    name = request.session.get("user")
    entry = web.users.get(name) if name else None
    if entry is None or not sessions.live(request.session.get("sid")):
        return None  # no user, or a cookie kept after its logout
    # The role is read from the config on every request: a demoted or removed user loses it at once.
    return Identity(name, entry["role"], "session")


class Sessions:
    """The sessions logged in and not logged out yet. The cookie is signed, not stored, so a
    copy kept from before a logout would otherwise stay good until it expires."""

    def __init__(self, max_age, most=10_000):
        self.max_age, self.most = max_age, most
        self.until = {}  # session id -> monotonic expiry, oldest first

    def start(self):
        now = time.monotonic()
        for sid in [sid for sid, until in self.until.items() if until <= now]:
            del self.until[sid]
        while len(self.until) >= self.most:  # bounded: the oldest login makes room
            del self.until[next(iter(self.until))]
        sid = secrets.token_urlsafe(24)
        self.until[sid] = now + self.max_age
        return sid

    def end(self, sid):
        self.until.pop(sid, None)

    def live(self, sid):
        return isinstance(sid, str) and self.until.get(sid, 0) > time.monotonic()


def is_loopback(host):
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def split_listen(listen):
    host, _, port = listen.rpartition(":")
    return host.strip("[]"), int(port)


def refuse_unsafe(web, listen):
    """Why the console must not start on ``listen`` with this config, or None."""
    host, _ = split_listen(listen)
    if not is_loopback(host) and not auth_configured(web):
        return (f"web.listen: {listen} is not a loopback address and no [web.users] or [web.tokens] are configured:"
                " anyone who reaches it could cancel jobs (add users with `tangguh web hash-password`, or listen on"
                " 127.0.0.1)")
    return None
