"""The Redis broker's connection: the URL's options, the client, and redis-py's errors as BrokerError.

URL: ``redis://[user:password@]host:port/db`` or ``rediss://...`` (TLS), with
options ``prefix=`` (key prefix, default ``tangguh``), ``done_ttl=`` (seconds a
done job is kept, default 7 days) and a few of redis-py's own
(``socket_timeout``, ``socket_connect_timeout``, ``health_check_interval``,
``client_name``, ``ssl_*``...). Any other option is an error.
"""
import functools
import typing
import urllib.parse

import redis
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

from ...errors import BrokerError, BrokerUnusable
from ...urls import redact

DEFAULT_PREFIX = "tangguh"
DEFAULT_DONE_TTL = 7 * 24 * 3600
# Options handed through to redis-py (parsed by redis.connection.parse_url).
REDIS_OPTIONS = {
    "db", "socket_timeout", "socket_connect_timeout", "socket_keepalive", "health_check_interval",
    "client_name", "max_connections", "retry_on_timeout", "protocol",
    "ssl_cert_reqs", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_check_hostname",
}


class Connection(typing.NamedTuple):
    client: redis.Redis
    prefix: str
    done_ttl: int
    where: str  # host:port, for messages (never the URL: it may hold a password)


def connect(url):
    """The client a broker URL names (no round trip yet), or BrokerUnusable naming what is wrong."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme.lower() not in ("redis", "rediss"):
        raise BrokerUnusable(f"redis url {redact(url)!r}: scheme must be redis:// or rediss://")
    options = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    ours = {k: v for k, v in options if k in ("prefix", "done_ttl")}
    unknown = sorted({k for k, _ in options if k not in REDIS_OPTIONS and k not in ours})
    if unknown:
        raise BrokerUnusable(f"redis url {redact(url)!r}: unknown option(s) {', '.join(unknown)}")
    prefix = ours.get("prefix", DEFAULT_PREFIX)
    if not prefix or "{" in prefix or "}" in prefix:
        raise BrokerUnusable(f"redis url {redact(url)!r}: prefix must be non-empty and without braces")
    try:
        done_ttl = int(ours.get("done_ttl", DEFAULT_DONE_TTL))
        if done_ttl < 1:
            raise ValueError
    except ValueError:
        raise BrokerUnusable(f"redis url {redact(url)!r}: done_ttl must be a positive number of seconds") from None
    rest = urllib.parse.urlencode([(k, v) for k, v in options if k in REDIS_OPTIONS])
    try:
        where = f"{parts.hostname or 'localhost'}:{parts.port or 6379}"
        client = redis.Redis.from_url(
            urllib.parse.urlunsplit(parts._replace(query=rest)),
            decode_responses=True,
            socket_connect_timeout=5.0,
            socket_timeout=30.0,
            # One immediate retry heals a pooled connection the server closed;
            # anything longer is the daemon's backoff to decide.
            retry=Retry(NoBackoff(), 1),
        )
    except (ValueError, TypeError, RedisError) as exc:
        raise BrokerUnusable(f"redis url {redact(url)!r}: {exc}") from None
    return Connection(client, prefix, done_ttl, where)


def guard(method):
    """Turn redis-py failures into BrokerError, so the daemon sees "broker down"."""

    @functools.wraps(method)
    def guarded(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except RedisError as exc:
            if _unusable(exc):
                raise BrokerUnusable(f"redis broker {self.where} refused the URL's settings: {exc}") from None
            kind = "unreachable" if isinstance(exc, (redis.ConnectionError, redis.TimeoutError)) else "error"
            raise BrokerError(f"redis broker {self.where} {kind}: {exc}") from None

    return guarded


def _unusable(exc):
    """Whether the server's answer says the URL can never work (a login it refuses, no such db number)."""
    return (isinstance(exc, (redis.exceptions.AuthenticationError, redis.exceptions.AuthorizationError))
            or (isinstance(exc, redis.ResponseError) and "DB index is out of range" in str(exc)))
