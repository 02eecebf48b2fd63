"""The Redis broker's connection: the URL's options, the client, and redis-py's errors as BrokerError.

URLs (``rediss`` instead of ``redis`` for TLS)::

    redis://[user:password@]host:port/db
    redis+sentinel://[user:password@]host:26379,host2:26379/<service>/db   (redis-py's Sentinel)
    redis+cluster://[user:password@]host:7000,host2:7001/                  (redis-py's RedisCluster)

The user and password are the Redis servers'; Sentinels that want their own
take ``sentinel_username=`` and ``sentinel_password=``. Options: ``prefix=``
(key prefix, default ``tangguh``), ``done_ttl=`` (seconds a done job is kept,
default 7 days), ``wait_replicas=N`` and ``wait_timeout=`` (ms, default 1000):
``WAIT N`` after each enqueue and outcome write (not on a cluster), and a few
of redis-py's own (``socket_timeout``, ``socket_connect_timeout``,
``health_check_interval``, ``client_name``, ``ssl_*``...). Any other option is
an error.
"""
import functools
import time
import typing
import urllib.parse

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import RedisClusterException, RedisError
from redis.retry import Retry
from redis.sentinel import MasterNotFoundError, Sentinel

from ...errors import BrokerError, BrokerUnusable
from ...urls import redact

SCHEMES = ("redis", "rediss", "redis+sentinel", "rediss+sentinel", "redis+cluster", "rediss+cluster")
DEFAULT_PREFIX = "tangguh"
DEFAULT_DONE_TTL = 7 * 24 * 3600
# A done job's hash outlives done_ttl by this (or by done_ttl, when shorter): prune deletes it at
# done_ttl and must still find its queued_at and type to take its search entries out with it.
DONE_GRACE = 3600
DEFAULT_WAIT_TIMEOUT = 1000  # ms WAIT gives the replicas to confirm a write
OURS = {"prefix", "done_ttl", "wait_replicas", "wait_timeout"}
SENTINEL_OPTIONS = {"sentinel_username", "sentinel_password"}
SENTINEL_LEAST_TIMEOUT = 0.5  # seconds: a Sentinel's share of the timeouts is never less
REASK_AFTER = 1.0  # seconds after the Sentinels named no primary before they are asked again


def _defaults():
    return dict(
        decode_responses=True,
        socket_connect_timeout=5.0,
        # The master's loop waits on its broker calls: a server that stops answering without
        # closing (SIGSTOP, a frozen VM, a partition) holds the loop, its status socket and the
        # systemd watchdog for this long a call. Every script is bounded (claims, acks, prune
        # and search work in batches), so a call that takes 5 s is an outage, not work.
        socket_timeout=5.0,
        # One immediate retry heals a pooled connection the server closed; anything longer is
        # the daemon's backoff. Not after a timeout: the retry reconnected to the address it had
        # (redis-py 8), a silent server's second wait; the supervisor's reconnect asks the
        # Sentinels (docs/brokers.md, Sentinel).
        retry=Retry(NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,)),
    )
# Options handed through to redis-py (parsed by redis.connection.parse_url).
REDIS_OPTIONS = {
    "db", "socket_timeout", "socket_connect_timeout", "socket_keepalive", "health_check_interval",
    "client_name", "max_connections", "retry_on_timeout", "protocol",
    "ssl_cert_reqs", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_check_hostname",
}


class Connection(typing.NamedTuple):
    client: redis.Redis  # or redis.cluster.RedisCluster
    prefix: str
    done_ttl: int
    where: str  # host:port (or the Sentinel service), for messages: never the URL, it may hold a password
    cluster: bool  # the client is a RedisCluster: commands of one pipeline may go to different nodes
    wait: typing.Optional[tuple]  # (replicas, timeout ms) for WAIT after writes, or None
    keep: bool  # one server (TLS or not), no max_connections: the scripts may keep a connection checked out (calls.py)


def connect(url):
    """The client a broker URL names (no round trip yet but a cluster's slot map), or BrokerUnusable."""
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        raise BrokerUnusable(f"redis url {redact(url)!r}: scheme must be one of {', '.join(SCHEMES)}")
    tls, _, topology = scheme.partition("+")
    options = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    allowed = REDIS_OPTIONS | OURS | (SENTINEL_OPTIONS if topology == "sentinel" else set())
    unknown = sorted({k for k, _ in options if k not in allowed})
    if unknown:
        raise BrokerUnusable(f"redis url {redact(url)!r}: unknown option(s) {', '.join(unknown)}")
    ours = {k: v for k, v in options if k in OURS}
    prefix = ours.get("prefix", DEFAULT_PREFIX)
    if not prefix or "{" in prefix or "}" in prefix:
        raise BrokerUnusable(f"redis url {redact(url)!r}: prefix must be non-empty and without braces")
    done_ttl = _whole(url, ours, "done_ttl", DEFAULT_DONE_TTL, 1, "a positive number of seconds")
    replicas = _whole(url, ours, "wait_replicas", 0, 0, "a whole number of replicas, 0 or more")
    timeout = _whole(url, ours, "wait_timeout", DEFAULT_WAIT_TIMEOUT, 1, "a positive number of milliseconds")
    wait = (replicas, timeout) if replicas else None
    if wait and topology == "cluster":
        raise BrokerUnusable(f"redis url {redact(url)!r}: wait_replicas is not supported on a cluster"
                             " (WAIT must follow the write on the same node's connection)")
    rest = [(k, v) for k, v in options if k in REDIS_OPTIONS]
    for key, value in rest:
        # 0 is no "wait for ever" to redis-py: every connect or read fails at once (EAGAIN), so
        # the supervisor waited out an outage that could never end, its config "ok".
        if key in ("socket_timeout", "socket_connect_timeout") and _seconds(value) is not None and \
                not _seconds(value) > 0:
            raise BrokerUnusable(f"redis url {redact(url)!r}: {key} must be a positive number of seconds")
    if wait:
        # WAIT's reply comes after wait_timeout: a read limit below it cuts every unconfirmed
        # write off as an outage (the connection dropped, the claims held) instead of saying so.
        try:
            limit = float(dict(rest).get("socket_timeout", _defaults()["socket_timeout"]))
        except ValueError:
            limit = None  # redis-py names the bad value below
        if limit is not None and timeout >= limit * 1000:
            raise BrokerUnusable(f"redis url {redact(url)!r}: wait_timeout ({timeout} ms) must be below"
                                 f" socket_timeout ({limit:g} s)")
    userinfo, _, hostlist = parts.netloc.rpartition("@")
    try:
        default_port = 26379 if topology == "sentinel" else 6379
        hosts = [_host_port(h, default_port) for h in hostlist.split(",")] if hostlist else [("localhost", 6379)]
        if topology == "sentinel":
            client, where = _sentinel(url, parts, tls, userinfo, hosts, rest, options)
        elif topology == "cluster":
            client, where = _cluster(url, parts, tls, userinfo, hosts, rest)
        else:
            if len(hosts) > 1:
                raise ValueError("one host only (several hosts need redis+sentinel:// or redis+cluster://)")
            where = f"{hosts[0][0]}:{hosts[0][1]}"
            client = redis.Redis.from_url(
                urllib.parse.urlunsplit(parts._replace(query=urllib.parse.urlencode(rest))),
                **_defaults())
    except BrokerError:
        raise
    except (ValueError, TypeError, RedisError, RedisClusterException) as exc:
        raise BrokerUnusable(f"redis url {redact(url)!r}: {exc}") from None
    keep = not topology and "max_connections" not in dict(rest)
    return Connection(client, prefix, done_ttl, where, topology == "cluster", wait, keep)


def _seconds(text):
    """``text`` as a float, or None where redis-py is left to name a value that is not one."""
    try:
        return float(text)
    except ValueError:
        return None


def _whole(url, ours, key, default, least, what):
    try:
        value = int(ours.get(key, default))
        if value < least:
            raise ValueError
    except ValueError:
        raise BrokerUnusable(f"redis url {redact(url)!r}: {key} must be {what}") from None
    return value


def _host_port(text, default_port):
    """``(host, port)`` of ``host[:port]`` or ``[v6 address][:port]``."""
    if text.startswith("["):
        host, _, port = text[1:].partition("]")
        port = port.lstrip(":")
    else:
        host, _, port = text.partition(":")
    if not host:
        raise ValueError(f"a host is missing in {text!r}")
    return host, int(port) if port else default_port


def _kwargs(tls, userinfo, db, rest, overrides=None):
    """redis-py's connection settings from the URL (parsed by redis-py itself), without host and port."""
    query = urllib.parse.urlencode(rest)
    kw = redis.connection.parse_url(f"redis://{userinfo + '@' if userinfo else ''}localhost/{db}?{query}")
    kw.pop("host", None)
    kw.pop("port", None)
    if tls == "rediss":
        kw["ssl"] = True
    return {**_defaults(), **(overrides or {}), **kw}


def sentinel_master(url, **overrides):
    """A client of the primary a ``redis+sentinel://`` URL names, for URLs whose query holds
    redis-py's options and ``sentinel_*`` only (the handler toolkit's Redis).

    ``overrides`` replace the broker's defaults (``decode_responses``, timeouts, retry).
    """
    parts = urllib.parse.urlsplit(url)
    tls = parts.scheme.lower().partition("+")[0]
    options = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    userinfo, _, hostlist = parts.netloc.rpartition("@")
    hosts = [_host_port(h, 26379) for h in hostlist.split(",")]
    rest = [(k, v) for k, v in options if k not in SENTINEL_OPTIONS]
    return _sentinel(url, parts, tls, userinfo, hosts, rest, options, overrides)[0]


def _sentinel(url, parts, tls, userinfo, hosts, rest, options, overrides=None):
    """``redis+sentinel://h:26379,h2:26379/service/db``: a client of the primary the Sentinels name now.

    Every new connection asks the Sentinels for the primary, so after a failover
    the next connection (a retry, a reconnect) reaches the promoted replica.
    """
    path = [p for p in parts.path.split("/") if p]
    if not path or len(path) > 2:
        raise ValueError("the path must be /<service name>[/<db>]")
    service, db = path[0], path[1] if len(path) > 1 else "0"
    if not db.isdigit():
        raise ValueError(f"db {db!r} must be a number")
    kw = _kwargs(tls, userinfo, db, rest, overrides)
    own = dict(options)
    sentinel_kw = {k: kw[k] for k in ("socket_connect_timeout", "socket_timeout", "ssl") if k in kw}
    for key in ("socket_connect_timeout", "socket_timeout"):
        if sentinel_kw.get(key):
            # Each Sentinel gets its share: with every one of them silent (a partition, a frozen host)
            # asking them all takes one timeout, not one each. A live Sentinel answers in milliseconds.
            sentinel_kw[key] = max(SENTINEL_LEAST_TIMEOUT, float(sentinel_kw[key]) / len(hosts))
    if own.get("sentinel_username"):
        sentinel_kw["username"] = own["sentinel_username"]
    if own.get("sentinel_password"):
        sentinel_kw["password"] = own["sentinel_password"]
    sentinels = TellingSentinel(hosts, sentinel_kwargs=sentinel_kw, **kw)
    return sentinels.master_for(service, **kw), f"sentinel service {service}"


class NoSuchService(MasterNotFoundError):
    """The Sentinels that answered monitor no service of the URL's name, or the address is no
    Sentinel at all: a URL that can never work, not a failover to wait out."""


class TellingSentinel(Sentinel):
    """redis-py's Sentinel, saying why it found no primary in one short line.

    redis-py's own message is the same for a service no Sentinel monitors (a typo in the URL, for
    ever) as for a primary the Sentinels hold down (a failover under way, seconds), and it shows the
    repr of every Sentinel's client. Each Sentinel's answer is read from the same round trips.
    """

    failed = (float("-inf"), None)  # (monotonic end, message) of the last discovery that found no primary

    def discover_master(self, service_name):
        at, message = self.failed
        if time.monotonic() - at < REASK_AFTER:
            # redis-py's immediate retry of the connection: the Sentinels were asked a moment ago, and
            # silent ones would hold the caller a timeout more. The supervisor's backoff asks again.
            raise MasterNotFoundError(message)
        try:
            return self._discover(service_name)
        except NoSuchService:
            raise
        except MasterNotFoundError as exc:
            self.failed = (time.monotonic(), str(exc))
            raise

    def _discover(self, service_name):
        seen = []  # what each Sentinel said, "host:port: ..."
        known = answered = 0
        for number, sentinel in enumerate(self.sentinels):
            kw = sentinel.connection_pool.connection_kwargs
            where = f"{kw.get('host')}:{kw.get('port')}"
            try:
                masters = sentinel.sentinel_masters()
            except redis.ResponseError as exc:
                if "unknown command" in str(exc):
                    raise NoSuchService(f"{where} is not a Sentinel (it refuses SENTINEL commands):"
                                        " list the Sentinels' addresses, or use redis:// for one server") from None
                seen.append(f"{where}: {exc}")
                continue
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                seen.append(f"{where}: {exc}")
                continue
            answered += 1
            state = masters.get(service_name)
            if state is None:
                continue
            known += 1
            if self.check_master_state(state, service_name):
                self.sentinels[0], self.sentinels[number] = sentinel, self.sentinels[0]
                return state["ip"], state["port"]
            seen.append(f"{where}: primary {state['ip']}:{state['port']} is down or not yet agreed on")
        if answered and not known:
            raise NoSuchService(f"no Sentinel monitors a service named {service_name!r}"
                                f" (the URL's path names the service: /<service name>/<db>)")
        raise MasterNotFoundError(f"no primary for service {service_name!r} now: {'; '.join(seen)}")


def _cluster(url, parts, tls, userinfo, hosts, rest):
    """``redis+cluster://h:7000,h:7001/``: a RedisCluster client (reads the slot map on creation)."""
    if parts.path.strip("/") not in ("", "0"):
        raise ValueError("a cluster has database 0 only: leave the path empty")
    kw = _kwargs(tls, userinfo, 0, rest)
    kw.pop("db", None)
    for key in ("retry", "retry_on_timeout"):  # the cluster client retries (and refreshes its slot map) itself
        kw.pop(key, None)
    try:
        client = CountingCluster(startup_nodes=[ClusterNode(h, p) for h, p in hosts], **kw)
    except (RedisError, RedisClusterException) as exc:
        if _unusable(exc):
            raise
        raise BrokerError(f"redis cluster {hosts[0][0]}:{hosts[0][1]} unreachable: {exc}") from None
    return client, f"cluster {hosts[0][0]}:{hosts[0][1]}"


class CountingCluster(RedisCluster):
    """A RedisCluster that counts the sendings whose answer it lost (``answers_lost``).

    Its own retries (a node failing over, a connection cut) resend a command whose
    first sending may have run on the server. On one server ``ScriptCalls._exchange``
    counts such a resend itself; on a cluster the retry happens inside redis-py, so
    the broker compares this count before and after a call instead. A failure before
    any connection was open (the node refusing connections) carried no command:
    redis-py 7.3 and later name the node, not a connection, in the exception then.
    An older redis-py does not say, and a refused connection after a MOVED or ASK
    names the connection of the redirected try: such a failure counts, which costs
    a needless orphan look, never a missed one.
    """

    answers_lost = 0

    def _execute_command(self, target_node, *args, **kwargs):
        try:
            return super()._execute_command(target_node, *args, **kwargs)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            if not isinstance(getattr(exc, "connection", None), ClusterNode):
                self.answers_lost += 1
            raise


def guard(method):
    """Turn redis-py failures into BrokerError, so the daemon sees "broker down"."""

    @functools.wraps(method)
    def guarded(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except (RedisError, RedisClusterException) as exc:
            if _unusable(exc):
                raise BrokerUnusable(f"redis broker {self.where} refused the URL's settings: {exc}") from None
            kind = "unreachable" if isinstance(exc, (redis.ConnectionError, redis.TimeoutError)) else "error"
            # A cluster mid-failover (CLUSTERDOWN, TRYAGAIN, slots moving) and a Sentinel that
            # names no primary yet are outages too: the next call asks again.
            raise BrokerError(f"redis broker {self.where} {kind}: {exc}") from None

    return guarded


def _unusable(exc):
    """Whether the server's answer says the URL can never work (a login it refuses, no such db number)."""
    return (isinstance(exc, (redis.exceptions.AuthenticationError, redis.exceptions.AuthorizationError,
                             NoSuchService))
            or (isinstance(exc, redis.ResponseError) and "DB index is out of range" in str(exc))
            # A redis:// URL naming a Sentinel (no TIME, no EVALSHA...), or a server without them.
            or (isinstance(exc, redis.ResponseError) and str(exc).startswith("unknown command"))
            # A redis+cluster:// URL naming a server that is not a cluster node.
            or (isinstance(exc, RedisClusterException) and "Cluster mode is not enabled" in str(exc)))
