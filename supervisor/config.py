"""Configuration: TOML in, validated dataclasses out.

Every key has a default, so an empty file is a valid config. Errors name the
key path (``broker.lease_seconds: expected a positive number of seconds up to 86400 (a day), got "abc"``);
unknown keys are errors too, because a misspelt key silently ignored is a
setting the operator believes in and does not have. Relative paths resolve
against the folder of the config file.
"""
import dataclasses
import os
import re
import tomllib
import urllib.parse

from .checks import (Unshown, boolean, cron, delay_seconds, field_names, file_mode, fraction, group_name,
                     listen_address, metrics_listen, name, non_negative_int, one_of, poll_interval, positive_int,
                     prefetch_setting, retention_seconds, queue_name, queue_names, rate, soft_timeout_seconds, string,
                     table, timeout_seconds, timezone, up_to_a_day, up_to_ten_years, url_of, web_accounts, worker_count)
from . import urls
from .errors import BadInput, ConfigError
from .scheduler import catch_up_count
from .model import check_json

DEFAULT_PATHS = ("./tangguh.toml", "/etc/tangguh/config.toml")


def option(check, doc, **kw):
    return dataclasses.field(metadata={"check": check, "doc": doc}, **kw)


# -- sections -----------------------------------------------------------------

@dataclasses.dataclass
class SupervisorConfig:
    workers: int = option(worker_count, "child worker processes", default=2)
    handlers: str = option(string, "folder of handler modules (*.py)", default="handlers")
    socket: str = option(string, "health socket path", default="tangguh.sock")
    socket_mode: int = option(file_mode, "health socket file mode", default=0o660)
    socket_group: str = option(group_name, "group the health socket is given (empty: the daemon's own)", default="")
    graceful_timeout: float = option(up_to_a_day, "seconds running jobs get to finish on SIGTERM", default=30.0)
    kill_grace: float = option(up_to_a_day, "seconds between SIGTERM and SIGKILL of a child", default=0.5)
    cancel_grace: float = option(up_to_a_day, "seconds a cancelled job's handler gets to stop before its"
                                 " child is killed", default=10.0)
    max_jobs_per_child: int = option(non_negative_int, "recycle a child after this many jobs (0: never)", default=0)
    max_child_rss_mb: int = option(non_negative_int, "recycle a child above this RSS (0: never)", default=0)
    max_boot_failures: int = option(positive_int, "consecutive child boot failures before giving up", default=5)
    cpu_affinity: str = option(one_of("off", "spread"), '"spread": each child pinned to the CPU of the'
                               ' supervisor\'s that the fewest children hold; "off": where the kernel puts it',
                               default="off")
    poll_interval: float = option(poll_interval, "longest wait between claims when idle", default=0.5)
    import_timeout: float = option(timeout_seconds, "seconds the trial import of the handler files may take",
                                   default=30.0)


@dataclasses.dataclass
class BrokerConfig:
    url: str = option(string, "sqlite:///file.db, redis://..., postgresql://...", default="sqlite:///tangguh.db")
    queues: list = option(queue_names, "queues served, in order of precedence", default_factory=lambda: ["default"])
    lease_seconds: float = option(up_to_a_day, "how long a claim holds a job without renewal", default=30.0)
    heartbeat_seconds: float = option(up_to_a_day, "how often held leases are renewed", default=5.0)
    prefetch: int | str = option(prefetch_setting, '"auto" (per job type, from its run times) or jobs claimed '
                                 "beyond the idle children", default="auto")
    migrate: bool = option(boolean, "create/upgrade broker tables at start", default=True)
    retention: float = option(retention_seconds, "seconds done jobs are kept (0: forever)", default=7 * 86400.0)
    redis_wait_replicas: int = option(non_negative_int, "Redis replicas that must confirm each enqueue and outcome"
                                      " write (WAIT; 0: none)", default=0)


@dataclasses.dataclass
class JobsConfig:
    timeout: float = option(timeout_seconds, "hard timeout: the child is killed", default=300.0)
    soft_timeout: float = option(soft_timeout_seconds, "JobTimeout raised in the handler (0: off)", default=0.0)
    max_attempts: int = option(positive_int, "attempts before dead-lettering", default=5)
    backoff_base: float = option(delay_seconds, "first retry delay, doubled per attempt", default=1.0)
    backoff_cap: float = option(delay_seconds, "longest retry delay", default=300.0)
    jitter: float = option(fraction, "fraction of a retry delay taken off at random", default=0.5)
    types: dict = option(dict, "per-type overrides", default_factory=dict)


@dataclasses.dataclass
class JobTypeConfig:
    """Overrides for one job type; None means 'use the decorator, then [jobs]'."""

    timeout: float | None = option(timeout_seconds, "hard timeout", default=None)
    soft_timeout: float | None = option(soft_timeout_seconds, "soft timeout", default=None)
    max_attempts: int | None = option(positive_int, "attempts", default=None)
    queue: str | None = option(queue_name, "queue this type is enqueued to", default=None)
    max_concurrency: int | None = option(positive_int, "most jobs of the type running at once", default=None)
    rate_limit: str | None = option(rate, 'most jobs started per second/minute/hour: "100/m"', default=None)
    exclusive: bool | None = option(boolean, "never two jobs with one resource_id at once", default=None)


@dataclasses.dataclass
class ScheduleConfig:
    """``[schedules.<name>]``: enqueue a job of ``type`` at every tick of ``cron``."""

    cron: str | None = option(cron, "cron expression; a 6th field, last, is seconds", default=None)
    type: str | None = option(name, "job type to enqueue", default=None)
    payload: dict = option(table, "the job's payload", default_factory=dict)
    queue: str | None = option(queue_name, "queue (default: the type's)", default=None)
    timezone: str = option(timezone, "time zone the cron fields are read in", default="UTC")
    catch_up: int = option(catch_up_count, "missed ticks enqueued after downtime (latest first)", default=1)


@dataclasses.dataclass
class LogConfig:
    level: str = option(one_of("debug", "info", "warning", "error"), "log level", default="info")
    format: str = option(one_of("auto", "text", "json"), "auto: text on a terminal, else JSON", default="auto")


@dataclasses.dataclass
class MetricsConfig:
    listen: str = option(metrics_listen, "host:port for HTTP /metrics (empty: off)", default="")


@dataclasses.dataclass
class ToolkitConfig:
    """The handlers' own database and Redis (``supervisor.toolkit``), not the broker's."""

    database_url: str = option(url_of("postgresql", "postgres", "sqlite"),
                               "handlers' database for ctx.transaction/idempotency (empty: none)", default="")
    redis_url: str = option(url_of("redis", "rediss", "unix", "redis+sentinel", "rediss+sentinel"),
                            "Redis for ctx.lock and ctx.cache (empty: none)", default="")
    idempotency_retention: float = option(up_to_ten_years, "seconds done idempotency records are kept",
                                          default=7 * 86400.0)


@dataclasses.dataclass
class WebConfig:
    """``tangguh web``, the console: a separate process reading the broker."""

    listen: str = option(listen_address, "host:port the console listens on", default="127.0.0.1:9465")
    users: dict = option(web_accounts("password"), "name -> {password = argon2 hash, role = admin|viewer}",
                         default_factory=dict)
    tokens: dict = option(web_accounts("sha256"), "bearer tokens for scripts: name -> {sha256, role}",
                          default_factory=dict)
    redact: list = option(field_names, "payload/result fields masked on every page and API answer",
                          default_factory=list)
    behind_proxy: bool = option(boolean, "take the client's address and scheme from X-Forwarded-For/-Proto"
                                " sent from 127.0.0.1 (a reverse proxy on this machine); false: the console has"
                                " no proxy, so a local process cannot choose the address the login throttle counts",
                                default=True)


@dataclasses.dataclass
class Config:
    supervisor: SupervisorConfig = dataclasses.field(default_factory=SupervisorConfig)
    broker: BrokerConfig = dataclasses.field(default_factory=BrokerConfig)
    jobs: JobsConfig = dataclasses.field(default_factory=JobsConfig)
    log: LogConfig = dataclasses.field(default_factory=LogConfig)
    metrics: MetricsConfig = dataclasses.field(default_factory=MetricsConfig)
    toolkit: ToolkitConfig = dataclasses.field(default_factory=ToolkitConfig)
    web: WebConfig = dataclasses.field(default_factory=WebConfig)
    schedules: dict = dataclasses.field(default_factory=dict)  # name -> ScheduleConfig
    path: str | None = None  # the file it came from

    def job_type(self, type_name):
        """The overrides for ``type_name`` (all None when it has none)."""
        return self.jobs.types.get(type_name) or JobTypeConfig()

    def to_dict(self):
        """The effective config as TOML-ready data (None values left out)."""
        out = {}
        for section in ("supervisor", "broker", "jobs", "log", "metrics", "toolkit", "web"):
            data = {k: v for k, v in dataclasses.asdict(getattr(self, section)).items() if v is not None}
            if section == "jobs":
                data["types"] = {t: {k: v for k, v in d.items() if v is not None} for t, d in data["types"].items()}
            out[section] = data
        if self.schedules:
            out["schedules"] = {n: {k: v for k, v in dataclasses.asdict(sc).items() if v is not None}
                                for n, sc in self.schedules.items()}
        return out


SECTIONS = {"supervisor": SupervisorConfig, "broker": BrokerConfig, "jobs": JobsConfig, "log": LogConfig,
            "metrics": MetricsConfig, "toolkit": ToolkitConfig, "web": WebConfig}


def _build(cls, data, path):
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a table")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            raise ConfigError(f"{path}.{key}: unknown key")
    values = {}
    for key, value in data.items():
        if key == "types" and cls is JobsConfig:
            values[key] = _types(value, f"{path}.types")
            continue
        try:
            values[key] = fields[key].metadata["check"](value)
        except Unshown as exc:
            raise ConfigError(f"{path}.{key}: {exc}") from None
        except ValueError as exc:
            raise ConfigError(f"{path}.{key}: {exc}, got {_show(value)}") from None
    return cls(**values)


def _types(data, path):
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a table")
    return {type_name: _build(JobTypeConfig, table, f"{path}.{type_name}") for type_name, table in data.items()}


def _schedules(data, path):
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a table")
    out = {}
    for sched_name, tbl in data.items():
        sc = out[sched_name] = _build(ScheduleConfig, tbl, f"{path}.{sched_name}")
        try:
            check_json(sc.payload, "payload")
        except BadInput as exc:
            raise ConfigError(f"{path}.{sched_name}.payload: {exc}") from None
        for key in ("cron", "type"):
            if getattr(sc, key) is None:
                raise ConfigError(f"{path}.{sched_name}.{key}: required")
    return out


def _show(value):
    if isinstance(value, str):
        return '"' + value + '"'
    return repr(value).lower() if isinstance(value, bool) else repr(value)


def from_dict(data, base_dir="."):
    """Validate parsed TOML ``data``; resolve relative paths against ``base_dir``."""
    for key in data:
        if key not in SECTIONS and key != "schedules":
            raise ConfigError(f"{key}: unknown section")
    cfg = Config(**{key: _build(SECTIONS[key], value, key) for key, value in data.items() if key in SECTIONS},
                 schedules=_schedules(data.get("schedules", {}), "schedules"))
    if cfg.broker.heartbeat_seconds >= cfg.broker.lease_seconds:
        raise ConfigError(
            f"broker.heartbeat_seconds: must be shorter than broker.lease_seconds ({cfg.broker.lease_seconds:g}),"
            f" got {cfg.broker.heartbeat_seconds:g}"
        )
    for type_name, t in cfg.jobs.types.items():
        if t.queue is not None and t.queue not in cfg.broker.queues:
            raise ConfigError(f"jobs.types.{type_name}.queue: {t.queue!r} is not in broker.queues")
    for sched_name, sc in cfg.schedules.items():
        if sc.queue is not None and sc.queue not in cfg.broker.queues:
            raise ConfigError(f"schedules.{sched_name}.queue: {sc.queue!r} is not in broker.queues")
    base_dir = os.path.abspath(base_dir)
    cfg.supervisor.handlers = os.path.normpath(os.path.join(base_dir, cfg.supervisor.handlers))
    cfg.supervisor.socket = os.path.normpath(os.path.join(base_dir, cfg.supervisor.socket))
    cfg.broker.url = resolve_broker_url(cfg.broker.url, base_dir)
    cfg.broker.url = with_wait_replicas(cfg.broker.url, cfg.broker.redis_wait_replicas)
    for key in ("database_url", "redis_url"):
        if urls.problem(getattr(cfg.toolkit, key)):
            raise ConfigError(f"toolkit.{key}: {urls.problem(getattr(cfg.toolkit, key))}")
    if cfg.toolkit.database_url.startswith("sqlite:"):
        try:
            cfg.toolkit.database_url = resolve_broker_url(cfg.toolkit.database_url, base_dir)
        except ConfigError as exc:
            raise ConfigError(str(exc).replace("broker.url", "toolkit.database_url", 1)) from None
    return cfg


def resolve_broker_url(url, base_dir):
    """Make a relative ``sqlite:///file.db`` absolute (``sqlite:////abs/file.db``)."""
    from .backends.base import scheme_of
    from .errors import BrokerError

    try:
        scheme = scheme_of(url)
    except BrokerError as exc:
        raise ConfigError(f"broker.url: {exc}") from None
    if urls.problem(url):
        raise ConfigError(f"broker.url: {urls.problem(url)}")
    if scheme != "sqlite":
        return url
    parts = urllib.parse.urlsplit(url)
    path = urllib.parse.unquote(parts.path)[1:]
    if not path or parts.netloc not in ("", "localhost"):  # sqlite://var/x.db: the host "var" was dropped
        raise ConfigError(f"broker.url: {url!r} names no database file (sqlite:///relative.db, sqlite:////abs.db)")
    path = os.path.normpath(os.path.join(base_dir, path))
    return "sqlite:///" + urllib.parse.quote(path) + ("?" + parts.query if parts.query else "")


def with_wait_replicas(url, replicas):
    """The broker URL with ``wait_replicas=`` from ``broker.redis_wait_replicas`` (how the broker gets it)."""
    if not replicas:
        return url
    scheme = url.partition("://")[0].lower()
    if scheme not in ("redis", "rediss", "redis+sentinel", "rediss+sentinel"):
        raise ConfigError(f"broker.redis_wait_replicas: only for a redis:// or redis+sentinel:// broker,"
                          f" not {scheme}://")
    named = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(url).query)).get("wait_replicas")
    if named is not None:
        if named != str(replicas):
            raise ConfigError(f"broker.redis_wait_replicas: {replicas} but broker.url says wait_replicas={named}")
        return url
    return url + ("&" if "?" in url else "?") + f"wait_replicas={replicas}"


# sun_path of struct sockaddr_un holds 108 bytes, the final NUL included.
SOCKET_PATH_MAX = 107


def check_host(cfg, run_makes=None):
    """What ``run`` needs from this machine beyond valid TOML: ConfigError naming the first gap. ``config
    check`` runs it too, so a config it passes also starts (``run_makes(folder)``: a socket folder systemd makes)."""
    from .toolkit import check_urls  # the handlers' URLs: a gap there fails every job that uses them
    check_urls(cfg.toolkit)
    s = cfg.supervisor
    if len(os.fsencode(s.socket)) > SOCKET_PATH_MAX:
        raise ConfigError(f"supervisor.socket: {s.socket} is {len(os.fsencode(s.socket))} bytes long,"
                          f" over the {SOCKET_PATH_MAX} a UNIX socket path may have")
    if not os.path.isdir(os.path.dirname(s.socket)) and not (run_makes and run_makes(os.path.dirname(s.socket))):
        raise ConfigError(f"supervisor.socket: folder {os.path.dirname(s.socket)} does not exist")
    from .health import socket_exists  # a file, folder or link there is refused at bind: say so here too
    socket_exists(s.socket)
    if not os.path.isdir(s.handlers):
        raise ConfigError(f"supervisor.handlers: {s.handlers} is not a folder"
                          " (`tangguh config init PATH` writes a config and a handlers folder with an example)")
    if s.socket_group:
        import grp

        try:
            grp.getgrnam(s.socket_group)
        except KeyError:
            raise ConfigError(f"supervisor.socket_group: cannot give {s.socket} to group {s.socket_group!r}:"
                              " no such group") from None


def find_config(path=None):
    """The config file to use: ``path`` if given, else the first default that exists."""
    if path:
        return path
    for candidate in DEFAULT_PATHS:
        if os.path.exists(candidate):
            return candidate
    return None


_TABLE = re.compile(r"\s*\[\s*([^\]]*?)\s*\]")
_SOCKET = re.compile(r"""\s*socket\s*=\s*("(?:[^"\\]|\\.)*"|'[^']*')""")


def socket_path(path=None):
    """The health socket a config file names, read leniently: for talking to a running
    supervisor while its config file is broken (say, just after a bad edit and a reload).

    Only ``socket = "..."`` under ``[supervisor]`` is read; a file that cannot be read,
    or does not name one, means the default, all resolved as ``load`` would.
    """
    found = find_config(path)
    if found is None:
        return os.path.join(os.getcwd(), SupervisorConfig.socket)
    base_dir = os.path.dirname(os.path.abspath(found))
    value, table = SupervisorConfig.socket, None
    try:
        with open(found, encoding="utf-8", errors="replace") as f:
            lines = f.read(MAX_CONFIG_BYTES).splitlines()
    except OSError:
        lines = []
    for line in lines:
        if m := _TABLE.match(line):
            table = m.group(1)
        elif table == "supervisor" and (m := _SOCKET.match(line)):
            try:
                value = tomllib.loads("v = " + m.group(1))["v"]
            except tomllib.TOMLDecodeError:
                pass
    return os.path.normpath(os.path.join(base_dir, value))


MAX_CONFIG_BYTES = 16 * 2**20


def load(path=None):
    """Read, validate and resolve a config file. No file at all means all defaults here (the
    command line refuses that for every command but ``config show``/``check``: cli.common)."""
    found = find_config(path)
    if found is None:
        return from_dict({}, os.getcwd())
    try:
        with open(found, "rb") as f:
            text = f.read(MAX_CONFIG_BYTES + 1)  # /dev/zero, a log file named by mistake: not all of it
        if len(text) > MAX_CONFIG_BYTES:
            raise ConfigError(f"{found}: over {MAX_CONFIG_BYTES // 2**20} MiB: not a config file")
        data = tomllib.loads(text.decode())
    except RecursionError:  # arrays nested thousands deep: tomllib recurses
        raise ConfigError(f"{found}: invalid TOML: nested too deep") from None
    except FileNotFoundError:
        raise ConfigError(f"{found}: no such config file") from None
    except OSError as exc:
        raise ConfigError(f"{found}: cannot read: {exc.strerror}") from None
    except UnicodeDecodeError as exc:  # TOML is UTF-8: a file saved as Latin-1 (an accent in a comment)
        raise ConfigError(f"{found}: not UTF-8 text (byte {exc.start}: {exc.object[exc.start:exc.start + 1]!r});"
                          " save it as UTF-8") from None
    except ValueError as exc:  # TOMLDecodeError, and an integer past Python's 4300 digits: a bare ValueError
        raise ConfigError(f"{found}: invalid TOML: {str(exc).split('; use sys.')[0]}") from None
    cfg = from_dict(data, os.path.dirname(os.path.abspath(found)))
    cfg.path = os.path.abspath(found)
    return cfg
