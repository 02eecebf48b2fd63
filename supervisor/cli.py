"""The ``tangguh`` command line.

Every command takes ``-c/--config PATH`` (default ``./tangguh.toml``, else
``/etc/tangguh/config.toml``, else built-in defaults); commands that print data
take ``--json``. Exit codes: 0 ok, 1 runtime error (broker unreachable, job not
found, no supervisor answering), 2 bad input, usage or config error. Every
error is one line on stderr (``tangguh: error: ...``), and input is checked
before the broker is opened, so a rejected command writes nothing.
"""
import argparse
import contextlib
import datetime
import json
import os
import re
import shutil
import sys
import time

from . import config as config_module
from . import schemas
from .errors import BadInput, ConfigError, NotDead, TangguhError
from .model import MAX_DEPTH
from .urls import redact

PROG = "tangguh"
EXAMPLE_CONFIG = "data/config.example.toml"
EXAMPLE_HANDLERS = "data/handlers/examples.py"


class UsageError(Exception):
    """Bad command line: exit 2."""


class Failure(Exception):
    """A runtime failure already phrased for the operator: exit 1."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        command = self.prog[len(PROG):].strip()
        raise UsageError(f"{command}: {message}" if command else message)


# -- entry point ----------------------------------------------------------------

def main(argv=None):
    for stream in (sys.stdout, sys.stderr):
        # A job's text may hold what the terminal's encoding cannot show (a lone
        # surrogate): show it escaped rather than fail the whole listing.
        with contextlib.suppress(AttributeError, ValueError):
            stream.reconfigure(errors="backslashreplace")
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        return args.func(args) or 0
    except UsageError as exc:
        return _fail(exc, 2)
    except (ConfigError, BadInput) as exc:
        return _fail(exc, 2)
    except (Failure, NotDead, TangguhError) as exc:
        return _fail(exc, 1)
    except OSError as exc:
        return _fail(f"{exc.filename + ': ' if exc.filename else ''}{exc.strerror or exc}", 1)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - the contract is one line, never a traceback
        if os.environ.get("TANGGUH_DEBUG"):
            raise
        return _fail(f"internal error: {type(exc).__name__}: {exc} (set TANGGUH_DEBUG=1 for a traceback)", 1)


def _fail(message, code):
    text = " ".join(str(message).split()) or "failed"
    try:
        sys.stdout.flush()
    except (BrokenPipeError, ValueError):
        pass
    print(f"{PROG}: error: {text}", file=sys.stderr)
    return code


def build_parser():
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-c", "--config", metavar="PATH", default=argparse.SUPPRESS,
                        help="config file (default: ./tangguh.toml, else /etc/tangguh/config.toml)")
    as_json = argparse.ArgumentParser(add_help=False)
    as_json.add_argument("--json", action="store_true", help="print JSON")
    to_socket = argparse.ArgumentParser(add_help=False)
    to_socket.add_argument("--socket", metavar="PATH", help="the supervisor's health socket (default: the config's"
                           " supervisor.socket; read leniently when the config file is broken)")

    parser = _Parser(prog=PROG, description="Tangguh: a pre-fork worker-queue supervisor.")
    parser.add_argument("--version", action="version", version=version_text())
    parser.add_argument("-c", "--config", metavar="PATH", default=None,
                        help="config file (default: ./tangguh.toml, else /etc/tangguh/config.toml)")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def command(parent, name, func, help, *parents):
        p = parent.add_parser(name, help=help, description=help, parents=[common, *parents])
        if func is not None:
            p.set_defaults(func=func)
        return p

    command(commands, "run", cmd_run, "run the supervisor in the foreground")

    p = command(commands, "enqueue", cmd_enqueue, "enqueue a job and print its id")
    p.add_argument("type", metavar="TYPE", help="job type (the handler's name)")
    p.add_argument("--payload", default="{}", metavar="JSON", help="payload: a JSON object (default {})")
    p.add_argument("--queue", metavar="Q", help="queue (default: the type's queue from the config)")
    p.add_argument("--resource-id", metavar="R", help="resource the job acts on")
    p.add_argument("--idempotency-key", metavar="K", help="returns the unfinished job with this key, if any")
    p.add_argument("--delay", type=float, default=0.0, metavar="S", help="seconds before the job is due")
    p.add_argument("--max-attempts", type=int, metavar="N", help="attempts before dead-lettering")
    p.add_argument("--timeout", type=float, metavar="S", help="hard timeout in seconds")
    p.add_argument("--priority", type=int, default=0, metavar="N", help="higher runs first within a queue")
    p.add_argument("--trace-id", metavar="T", help="trace id (default: a new one)")

    command(commands, "status", cmd_status, "show the running supervisor's workers", as_json,
            to_socket).add_argument(
        "--watch", nargs="?", const=1.0, type=float, metavar="SECONDS", help="refresh every SECONDS (default 1)")
    command(commands, "metrics", cmd_metrics, "print the supervisor's Prometheus metrics", to_socket)
    command(commands, "stats", cmd_stats, "show per-queue counts", as_json)
    command(commands, "schedules", cmd_schedules, "list the periodic jobs with their next run", as_json)
    command(commands, "job", cmd_job, "show one job with its history", as_json).add_argument("job_id", metavar="ID")

    dlq = command(commands, "dlq", None, "inspect and replay dead-lettered jobs")
    dlq_commands = dlq.add_subparsers(dest="dlq_command", metavar="COMMAND", required=True)
    p = command(dlq_commands, "list", cmd_dlq_list, "list dead jobs, most recently failed first", as_json)
    p.add_argument("--type", metavar="T", help="only jobs of this type")
    p.add_argument("--limit", type=int, default=100, metavar="N", help="at most N jobs (default 100; 0: all)")
    command(dlq_commands, "show", cmd_dlq_show, "show a dead job: reason, error, attempts", as_json).add_argument(
        "job_id", metavar="ID")
    p = command(dlq_commands, "replay", cmd_dlq_replay, "put dead jobs back on their queue")
    p.add_argument("job_ids", nargs="*", metavar="ID")
    p.add_argument("--all", action="store_true", help="every dead job (of --type)")
    p.add_argument("--type", metavar="T", help="with --all: only jobs of this type")
    p.add_argument("--rate", type=float, metavar="N", help="at most N replays per second")
    p = command(dlq_commands, "purge", cmd_dlq_purge, "delete dead jobs for good")
    p.add_argument("job_ids", nargs="*", metavar="ID")
    p.add_argument("--all", action="store_true", help="every dead job (of --type); needs --yes")
    p.add_argument("--type", metavar="T", help="with --all: only jobs of this type")
    p.add_argument("--yes", action="store_true", help="confirm --all")

    cfg = command(commands, "config", None, "check, show or create a config file")
    cfg_commands = cfg.add_subparsers(dest="config_command", metavar="COMMAND", required=True)
    command(cfg_commands, "check", cmd_config_check, "validate the config")
    command(cfg_commands, "show", cmd_config_show, "print the effective config, defaults included", as_json)
    p = command(cfg_commands, "init", cmd_config_init, "write a starter config, or install the systemd service")
    p.add_argument("path", metavar="PATH", nargs="?", help="where to write the config (not with --systemd)")
    p.add_argument("--systemd", action="store_true",
                   help="install as a service: user, /etc/tangguh/{config.toml,handlers/}, the unit (docs/service.md)")
    p.add_argument("--root", default="/", metavar="DIR", help="with --systemd: write the files under DIR "
                   "(for packaging and tests); accounts and systemctl are left alone")
    p.add_argument("--user", default="tangguh", metavar="NAME", help="with --systemd: service user (default tangguh)")
    p.add_argument("--group", default="tangguh", metavar="NAME", help="with --systemd: service group (default tangguh)")
    p.add_argument("--exec", dest="exec_path", metavar="PATH",
                   help="with --systemd: the tangguh command for ExecStart= (default: this installation's)")
    p.add_argument("--dry-run", action="store_true", help="with --systemd: print what would be done, do nothing")

    db = command(commands, "db", None, "broker storage")
    db_commands = db.add_subparsers(dest="db_command", metavar="COMMAND", required=True)
    command(db_commands, "migrate", cmd_db_migrate,
            "create or upgrade the broker's tables (and the toolkit's, if toolkit.database_url is set)")

    command(commands, "demo", cmd_demo, "run a demonstration").add_argument(
        "args", nargs=argparse.REMAINDER, metavar="NAME", help="demo name and its arguments")
    return parser


# -- helpers ------------------------------------------------------------------

def version_text():
    import platform

    from . import __version__

    return f"{PROG} {__version__} (Python {platform.python_version()})"


def load_config(args):
    return config_module.load(args.config)


def open_client(args, cfg=None):
    from .client import Client

    return Client.from_config(cfg or load_config(args))


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


# -- config -------------------------------------------------------------------

def cmd_config_check(args):
    cfg = load_config(args)
    config_module.check_host(cfg)
    print(f"ok: {cfg.path or 'no config file found, built-in defaults'}")


def cmd_config_show(args):
    cfg = load_config(args)
    data = cfg.to_dict()
    if args.json:
        print_json(data)
        return
    import tomli_w

    source = cfg.path or "built-in defaults (no config file found)"
    sys.stdout.write(f"# effective config from {source}\n" + tomli_w.dumps(data))


def example_config():
    """The text of the starter config (``config.example.toml``, shipped in the package)."""
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), EXAMPLE_CONFIG), encoding="utf-8") as f:
        return f.read()


def cmd_config_init(args):
    if args.systemd:
        if args.path:
            raise UsageError("config init --systemd: takes no PATH (the config goes to /etc/tangguh/config.toml)")
        return daemon_module("install").main(args)
    if not args.path:
        raise UsageError("config init: give the PATH to write, or --systemd")
    text = example_config()
    try:
        with open(args.path, "x", encoding="utf-8") as f:
            f.write(text)
    except FileExistsError:
        raise UsageError(f"{args.path}: already exists, not overwriting it") from None
    print(f"wrote {args.path}")
    # The starter config names ./handlers beside it: make it, with the example handlers the
    # README's walk-through enqueues, so `tangguh run` starts at once and its first job runs.
    handlers = config_module.load(args.path).supervisor.handlers
    if not os.path.isdir(handlers):
        os.makedirs(handlers, exist_ok=True)
        print(f"made {handlers}/ (drop handler modules here)")
        example = os.path.join(handlers, os.path.basename(EXAMPLE_HANDLERS))
        shutil.copyfile(os.path.join(os.path.dirname(os.path.abspath(__file__)), EXAMPLE_HANDLERS), example)
        print(f"wrote {example} (example handlers: hash_chain, sleep, flaky, always_permanent)")


# -- producing and reading ----------------------------------------------------

_JSON_TYPES = {dict: "object", list: "list", str: "string", int: "number", float: "number", bool: "boolean",
               type(None): "null"}


def parse_payload(text):
    try:
        payload = json.loads(text)
    except ValueError as exc:
        raise BadInput(f"payload: malformed JSON: {exc}") from None
    except RecursionError:
        raise BadInput(f"payload: nested more than {MAX_DEPTH} levels deep") from None
    if not isinstance(payload, dict):
        raise BadInput(f"payload: expected a JSON object, got {_JSON_TYPES.get(type(payload), type(payload).__name__)}")
    return payload


def cmd_enqueue(args):
    payload = parse_payload(args.payload)
    cfg = load_config(args)
    payload = schemas.check_cli_payload(cfg, args.type, payload)  # the handler's schema, when importable
    with open_client(args, cfg) as client:
        # new_job checks everything before the broker is opened: a bad value stores nothing.
        options = dict(queue=args.queue, resource_id=args.resource_id, idempotency_key=args.idempotency_key,
                       delay=args.delay, max_attempts=args.max_attempts, timeout=args.timeout,
                       trace_id=args.trace_id, priority=args.priority)
        client.new_job(args.type, payload, **options)
        print(client.enqueue(args.type, payload, **options))


def get_job(broker, job_id):
    job = broker.get(job_id)
    if job is None:
        raise Failure(f"job {job_id} not found")
    return job


def cmd_job(args):
    with open_client(args) as client:
        job = get_job(client.broker, args.job_id)
    if args.json:
        print_json(job.to_dict())
    else:
        say(render_job(job))


def render_job(job):
    """A job, every field and its history, for reading."""
    state = job.state + (f" ({job.reason})" if job.reason else "")
    fields = [
        ("id", job.id), ("type", job.type), ("queue", job.queue), ("state", state),
        ("attempt", f"{job.attempt} of {job.max_attempts}"), ("priority", job.priority),
        ("payload", json.dumps(job.payload, sort_keys=True)), ("resource_id", job.resource_id),
        ("idempotency_key", job.idempotency_key), ("trace_id", job.trace_id),
        ("timeout", duration(job.timeout) if job.timeout else "-"),
        ("queued_at", when(job.queued_at)), ("run_at", when(job.run_at)),
        ("lease", f"token {job.token}, owner {job.owner or '-'}, until {when(job.lease_until)}"),
        ("first_failure_at", when(job.first_failure_at)), ("last_failure_at", when(job.last_failure_at)),
        ("finished_at", when(job.finished_at)),
        ("result", "-" if job.result is None else json.dumps(job.result, sort_keys=True)),
    ]
    lines = [f"{k + ':':<17} {'-' if v is None else v}" for k, v in fields]
    return "\n".join(lines + render_error(job.error, "error:") + render_history(job.history))


def render_history(history):
    lines = [f"history:          {len(history)} attempt(s)"]
    for entry in history:
        lines.append("  " + render_attempt(entry))
        err = entry.get("error")
        if isinstance(err, dict):
            lines.append(f"      {err.get('class') or err.get('reason') or 'error'}: {one_line(err.get('message'), 100)}")
    return lines


def render_error(error, label):
    if not error:
        return [f"{label:<17} -"]
    lines = [f"{label:<17} {error.get('class') or '-'}: {error.get('message') or ''}".rstrip(),
             f"  reason:         {error.get('reason') or '-'}"]
    if error.get("traceback"):
        lines.append("  traceback:")
        lines += ["    " + line for line in str(error["traceback"]).rstrip().splitlines()]
    return lines


def render_attempt(entry):
    started, ended = entry.get("started_at"), entry.get("ended_at")
    took = duration(ended - started) if started is not None and ended is not None else "-"
    text = (f"#{entry.get('attempt', '?')} {entry.get('outcome') or 'running'} started {when(started)}"
            f" ended {when(ended)} ({took}) owner {entry.get('owner') or '-'}")
    known = {"attempt", "outcome", "started_at", "ended_at", "owner", "error"}
    extra = {k: v for k, v in entry.items() if k not in known}
    if extra:
        text += " " + " ".join(f"{k}={v}" for k, v in sorted(extra.items()))
    return text


def cmd_stats(args):
    with open_client(args) as client:
        stats = client.stats()
    if args.json:
        print_json({q: s.to_dict() for q, s in stats.items()})
        return
    headers = ["QUEUE", "READY", "SCHEDULED", "IN_FLIGHT", "DEAD", "DONE", "OLDEST_READY"]
    rows = [[q, s.ready, s.scheduled, s.in_flight, s.dead, s.done, duration(s.oldest_ready_age) if s.ready else "-"]
            for q, s in stats.items()]
    say(table(headers, rows))


def cmd_schedules(args):
    """``[schedules.*]`` plus the handlers' ``cron=``; next runs by this host's clock."""
    import datetime
    import time

    from . import registry, scheduler

    cfg = load_config(args)
    handlers = registry.load_handlers(cfg.supervisor.handlers) if os.path.isdir(cfg.supervisor.handlers) else {}
    listing = scheduler.Scheduler(scheduler.schedules_from(cfg, handlers), None).listing(time.time())
    for item in listing:
        item["next_run_iso"] = datetime.datetime.fromtimestamp(item["next_run"], datetime.timezone.utc).isoformat()
    if args.json:
        print_json(listing)
        return
    if not listing:
        print("no schedules")
        return
    rows = [[i["name"], i["cron"], i["timezone"], i["type"], i["queue"] or "-", i["next_run_iso"]] for i in listing]
    say(table(["NAME", "CRON", "TIMEZONE", "TYPE", "QUEUE", "NEXT_RUN (UTC)"], rows))


# -- dead letters -------------------------------------------------------------

def cmd_dlq_list(args):
    if args.limit < 0:
        raise UsageError("dlq list: --limit must be >= 0")
    with open_client(args) as client:
        jobs = client.broker.dlq_list(type=args.type, limit=args.limit or None)
    if args.json:
        print_json([job.to_dict() for job in jobs])
        return
    if not jobs:
        print("no dead jobs" + (f" of type {args.type}" if args.type else ""))
        return
    rows = [[j.id, j.type, j.queue, j.reason, f"{j.attempt}/{j.max_attempts}", when(j.last_failure_at),
             one_line(((j.error or {}).get("class") or "") + ": " + ((j.error or {}).get("message") or ""), 50)]
            for j in jobs]
    say(table(["ID", "TYPE", "QUEUE", "REASON", "ATTEMPTS", "LAST_FAILURE", "ERROR"], rows))


def dead_job(broker, job_id):
    job = get_job(broker, job_id)
    if job.state != "dead":
        raise NotDead(f"job {job_id} is {job.state}, not dead")
    return job


def cmd_dlq_show(args):
    with open_client(args) as client:
        job = dead_job(client.broker, args.job_id)
    if args.json:
        print_json(job.to_dict())
        return
    lines = [f"{'id:':<17} {job.id}", f"{'type:':<17} {job.type}", f"{'queue:':<17} {job.queue}",
             f"{'reason:':<17} {job.reason or '-'}",
             f"{'attempts:':<17} {job.attempt} of {job.max_attempts}",
             f"{'first_failure_at:':<17} {when(job.first_failure_at)}",
             f"{'last_failure_at:':<17} {when(job.last_failure_at)}",
             f"{'payload:':<17} {json.dumps(job.payload, sort_keys=True)}"]
    say("\n".join(lines + render_error(job.error, "error:") + render_history(job.history)))


def _selection(args, verb):
    if args.all and args.job_ids:
        raise UsageError(f"dlq {verb}: give job ids or --all, not both")
    if not args.all and not args.job_ids:
        raise UsageError(f"dlq {verb}: give job ids or --all")
    if args.type and not args.all:
        raise UsageError(f"dlq {verb}: --type only goes with --all")


def cmd_dlq_replay(args):
    _selection(args, "replay")
    if args.rate is not None and not args.rate > 0:
        raise UsageError("dlq replay: --rate must be a positive number of replays per second")
    with open_client(args) as client:
        broker = client.broker
        if args.all:
            ids = [job.id for job in broker.dlq_list(type=args.type, limit=None)]
        else:
            ids = list(dict.fromkeys(args.job_ids))
            for job_id in ids:  # all or nothing: check every id before replaying any
                dead_job(broker, job_id)
        if args.rate is None:
            for start in range(0, len(ids), 500):
                broker.dlq_replay(ids[start:start + 500])
        else:
            began = time.monotonic()
            for i, job_id in enumerate(ids):
                pause = began + i / args.rate - time.monotonic()
                if pause > 0:
                    time.sleep(pause)  # pacing, so a replay storm does not flood the workers
                broker.dlq_replay([job_id])
    print(f"replayed {len(ids)} job(s)")


def cmd_dlq_purge(args):
    _selection(args, "purge")
    if args.all and not args.yes:
        raise UsageError("dlq purge: --all deletes every dead job" + (f" of type {args.type}" if args.type else "")
                         + " for good; add --yes to confirm")
    with open_client(args) as client:
        broker = client.broker
        if args.all:
            ids = [job.id for job in broker.dlq_list(type=args.type, limit=None)]
        else:
            ids = list(dict.fromkeys(args.job_ids))
            for job_id in ids:
                dead_job(broker, job_id)
        purged = 0
        for start in range(0, len(ids), 500):
            purged += broker.dlq_purge(ids[start:start + 500])
    print(f"purged {purged} job(s)")


# -- broker storage -----------------------------------------------------------

def cmd_db_migrate(args):
    cfg = load_config(args)
    with open_client(args, cfg) as client:
        client.broker.migrate()
        print(f"migrated {redact(client.url)}: tables and indexes are up to date")
    if cfg.toolkit.database_url:  # the handlers' database: idempotency_records
        from . import toolkit

        toolkit.migrate(cfg.toolkit.database_url)
        print(f"migrated {redact(cfg.toolkit.database_url)}: idempotency_records is up to date")


# -- the daemon (its modules are imported only when these commands run) -------

def daemon_module(name):
    """Import a daemon module on demand (the producer commands never load the daemon)."""
    import importlib

    try:
        return importlib.import_module(f"{__package__ or 'supervisor'}.{name}")
    except ImportError as exc:
        raise Failure(f"this installation has no supervisor.{name} ({exc})") from None


def cmd_run(args):
    return daemon_module("master").run(config_module.find_config(args.config))


def cmd_demo(args):
    return daemon_module("demo").main(list(args.args))


def supervisor_socket(args):
    """The socket to ask: ``--socket``, else the config's; a broken config warns and is read leniently.

    The config is most often broken just after an edit and a reload, exactly
    when the operator needs ``status`` to see the running generation.
    """
    if args.socket:
        return os.path.abspath(args.socket)
    try:
        return load_config(args).supervisor.socket
    except ConfigError as exc:
        path = config_module.socket_path(args.config)
        print(f"{PROG}: warning: {' '.join(str(exc).split())}; asking the supervisor on {path}", file=sys.stderr)
        return path


def ask_supervisor(socket_path, request):
    """Send one request to the health socket; a Failure naming the socket when nobody answers."""
    health = daemon_module("health")
    try:
        reply = health.request(socket_path, request)
    except ValueError as exc:  # not JSON
        raise Failure(f"supervisor on {socket_path} sent an invalid reply ({exc})") from None
    except (OSError, TangguhError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        if isinstance(exc, TangguhError) and socket_path in reason:
            raise Failure(reason) from None  # already says which socket and what went wrong
        raise Failure(f"no supervisor answering on {socket_path} ({reason})") from None
    if not isinstance(reply, dict):
        raise Failure(f"supervisor on {socket_path} sent a reply that is not a JSON object")
    if reply.get("ok") is False:
        raise Failure(f"supervisor on {socket_path}: {reply.get('error') or 'request refused'}")
    return reply


def cmd_metrics(args):
    reply = ask_supervisor(supervisor_socket(args), {"cmd": "metrics"})
    text = reply.get("text", "")
    sys.stdout.write(text if text.endswith("\n") or not text else text + "\n")


def cmd_status(args):
    path = supervisor_socket(args)
    reply = ask_supervisor(path, {"cmd": "status"})
    if args.watch is None:
        print_json(reply) if args.json else say(render_status(reply))
        return
    if not args.watch > 0:
        raise UsageError("status: --watch needs a positive number of seconds")
    if not args.json:
        pending = [reply]

        def fetch():
            if pending:
                return pending.pop()
            try:
                return ask_supervisor(path, {"cmd": "status"})
            except Failure as exc:  # keep watching across a restart
                return {"error": str(exc)}

        return daemon_module("watch").run(fetch, args.watch)
    try:
        while True:
            screen = json.dumps(reply, indent=2, default=str) if args.json else printable(render_status(reply))
            sys.stdout.write("\033[H\033[2J" + screen + "\n")
            sys.stdout.flush()
            time.sleep(args.watch)
            try:
                reply = ask_supervisor(path, {"cmd": "status"})
            except Failure as exc:  # keep watching across a restart
                reply = {"error": str(exc)}
    except KeyboardInterrupt:
        return 0


def render_status(reply, now=None):
    """The reply of ``{"cmd": "status"}`` as a readable report (pure: no I/O)."""
    if reply.get("error") and "workers" not in reply:
        return f"error: {reply['error']}"
    now = time.time() if now is None else now
    started = reply.get("started_at")
    up = f"up {duration(now - started)} (since {when(started)})" if isinstance(started, (int, float)) else ""
    version = f"  version {reply['version']}" if reply.get("version") else ""  # older daemons do not say
    lines = [f"supervisor pid {reply.get('pid', '-')}  generation {reply.get('generation', '-')}{version}"
             f"  {up}".rstrip()]
    for key in ("config", "broker"):
        lines.append(f"{key + ':':<8} {_flat(reply.get(key))}")
    state = ["stopping" if reply.get("stopping") else "running"]
    if reply.get("broker_down"):
        state.append("BROKER DOWN (not claiming, retrying the connection)")
    for key, label in (("target_workers", "target workers"), ("prefetched", "prefetched"),
                       ("pending_writes", "pending writes")):
        if key in reply:
            state.append(f"{label} {_flat(reply[key])}")
    lines.append(f"{'state:':<8} " + ", ".join(state))
    if "handlers" in reply:
        lines.append(f"{'types:':<8} {', '.join(map(str, reply['handlers'])) or '-'}")
    if reply.get("reload_error"):
        lines.append(f"RELOAD FAILED (running the previous generation): {_flat(reply['reload_error'])}")
    workers = reply.get("workers") or []
    busy = sum(1 for w in workers if w.get("job_id"))
    lines.append(f"workers: {len(workers)} ({busy} busy)  restarts: {_flat(reply.get('restarts', 0))}")
    if workers:
        rows = [[w.get("slot"), w.get("pid"), w.get("state"), w.get("job_id") or "-", w.get("job_type") or "-",
                 w.get("attempt") if w.get("job_id") else "-",
                 duration(w.get("elapsed")) if w.get("job_id") and w.get("elapsed") is not None else "-",
                 size(w.get("rss_bytes")), w.get("jobs_done"), w.get("generation")]
                for w in workers]
        lines.append(table(["SLOT", "PID", "STATE", "JOB", "TYPE", "ATTEMPT", "ELAPSED", "RSS", "DONE", "GEN"],
                           rows))
    counters = reply.get("counters") or {}
    if counters:
        lines.append("counters: " + "  ".join(f"{k}={_flat(v)}" for k, v in sorted(counters.items())))
    return "\n".join(lines)


def _flat(value):
    """A value of a status reply on one line."""
    if value is None:
        return "-"
    if isinstance(value, dict):
        return " ".join(f"{k}={_flat(v)}" for k, v in value.items()) or "-"
    if isinstance(value, (list, tuple)):
        return ",".join(_flat(v) for v in value) or "-"
    if isinstance(value, str) and "://" in value:
        return redact(value)
    return str(value)


if __name__ == "__main__":
    sys.exit(main())
