"""Setting up: ``config check|show|init``, ``db migrate``, ``demo``."""
import os
import shutil
import sys

from .. import config as config_module, scheduler
from ..backends import open_broker
from ..errors import BrokerError, BrokerUnusable, ConfigError
from ..urls import MASK, redact
from .common import DATA, PROG, UsageError, daemon_module, import_handlers, load_config, open_client
from .output import print_json, printable

EXAMPLE_CONFIG = os.path.join(DATA, "config.example.toml")
EXAMPLE_HANDLERS = os.path.join(DATA, "handlers", "examples.py")


def cmd_config_check(args):
    cfg = config_module.load(args.config)  # no file: the defaults, and it says so
    config_module.check_host(cfg, run_makes=made_by_systemd)
    # The handlers as `run` imports them: their schedules' jobs and payloads must be storable and pass their schemas.
    scheduler.check_schedules(cfg, import_handlers(cfg))
    check_broker(cfg.broker.url)
    print(f"ok: {cfg.path or 'no config file found, built-in defaults'}")


def made_by_systemd(folder):
    """Whether a missing socket folder is one under /run, which systemd makes as the service starts
    (the unit's ``RuntimeDirectory=``) and which is gone while it is stopped: warned of, not refused."""
    if not os.path.realpath(folder).startswith("/run/"):
        return False
    print(f"{PROG}: warning: supervisor.socket: folder {printable(folder)} does not exist now; `tangguh run`"
          " needs it there (systemd makes it as the service starts: the unit's RuntimeDirectory=)", file=sys.stderr)
    return True


def check_broker(url):
    """One round trip to a broker server, as ``run`` makes at start: settings it refuses (an
    unknown option, database or login) fail the check as they fail ``run`` (exit 2); a server
    that does not answer now is only a warning (``run`` waits it out). A SQLite URL is only
    read (an unknown option, a bad busy_timeout), and an existing file only opened read-only
    (another application's table under one of Tangguh's names): opening it to write would create it."""
    if url.startswith("sqlite:"):
        from ..backends.sqlite import schema
        from ..backends.sqlite.database import read_url
        try:
            schema.check_file(read_url(url)[0])
        except BrokerUnusable as exc:
            raise ConfigError(f"broker.url: {exc}") from None
        return
    try:
        broker = open_broker(url)
        try:
            broker.now()
            if hasattr(broker, "check_schema"):
                broker.check_schema()  # PostgreSQL: another application's tables under our names
        finally:
            broker.close()
    except BrokerUnusable as exc:
        raise ConfigError(f"broker.url: {exc}") from None
    except BrokerError as exc:
        text = " ".join(printable(exc).split())
        print(f"{PROG}: warning: broker.url: not reachable now ({text}); `tangguh run` waits for it", file=sys.stderr)


SECRET_KEYS = ("password", "sha256")  # web.users.*.password (argon2 hash), web.tokens.*.sha256


def masked(data):
    """``data`` with every URL's password and every credential hash replaced by the mask.

    ``config show`` output ends up pasted in tickets and chat; a hash is still a secret
    (an offline attack on it is a guess away).
    """
    out = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out[key] = masked(value)
        elif isinstance(value, str) and key.endswith("url") and value:
            out[key] = redact(value)
        elif isinstance(value, str) and key in SECRET_KEYS and value:
            out[key] = MASK
        else:
            out[key] = value
    return out


def cmd_config_show(args):
    cfg = config_module.load(args.config)  # no file: the defaults
    data = cfg.to_dict() if args.show_secrets else masked(cfg.to_dict())
    if args.json:
        print_json(data)
        return
    import tomli_w

    source = cfg.path or "built-in defaults (no config file found)"
    sys.stdout.write(f"# effective config from {source}\n" + tomli_w.dumps(data))


def example_config():
    """The text of the starter config (``config.example.toml``, shipped in the package)."""
    with open(EXAMPLE_CONFIG, encoding="utf-8") as f:
        return f.read()


def cmd_config_init(args):
    if args.systemd:
        if args.path:
            raise UsageError("config init --systemd: takes no PATH (the config goes to /etc/tangguh/config.toml)")
        return daemon_module("cli.install").main(args)
    if not args.path:
        raise UsageError("config init: give the PATH to write, or --systemd")
    for option, value in (("--dry-run", args.dry_run), ("--root", args.root), ("--user", args.user),
                          ("--group", args.group), ("--exec", args.exec_path)):
        if value not in (None, False):  # else dropped without a word: a --dry-run wrote the file all the same
            raise UsageError(f"config init: {option} only goes with --systemd")
    text = example_config()
    folder = os.path.dirname(os.path.abspath(args.path))
    # A wrong path is bad input (exit 2), not the runtime failure the open's OSError would make it.
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise UsageError(f"config init: {os.path.dirname(args.path) or folder} is not a folder")
    if not os.path.isdir(folder):
        raise UsageError(f"config init: folder {os.path.dirname(args.path) or folder} does not exist (make it first)")
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
        shutil.copyfile(EXAMPLE_HANDLERS, example)
        print(f"wrote {example} (example handlers: hash_chain, sleep, flaky, always_permanent)")


def cmd_db_migrate(args):
    cfg = load_config(args)
    with open_client(args, cfg) as client:
        client.broker.migrate()
        print(f"migrated {redact(client.url)}: tables and indexes are up to date")
    if cfg.toolkit.database_url:  # the handlers' database: idempotency_records
        from .. import toolkit

        toolkit.migrate(cfg.toolkit.database_url)
        print(f"migrated {redact(cfg.toolkit.database_url)}: idempotency_records is up to date")


def cmd_demo(args):
    """``demo``: the tour; ``demo invoices [...]``: the handler toolkit's demo."""
    if not args.args:
        return daemon_module("cli.demo").main()
    name, *rest = args.args
    if name != "invoices":
        raise UsageError(f"unknown demo {name!r} (try: tangguh demo, tangguh demo invoices)")
    return daemon_module("cli.demo_invoices").main(rest)
