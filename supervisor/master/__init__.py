"""The supervisor's master process, one role per module; ``arbiter`` wires them (docs/design.md)."""
import sys

from .. import config, logs, registry
from ..errors import BrokerError, ConfigError
from .arbiter import EXIT_BOOT, EXIT_CONFIG, EXIT_ERROR, EXIT_OK, EXIT_RUNNING, Arbiter  # noqa: F401


def run(config_path=None):
    """``tangguh run``: load everything, then supervise until stopped. Returns the exit code."""
    try:
        cfg = config.load(config_path)
    except ConfigError as exc:
        print(f"tangguh: error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    logs.setup(cfg.log.level, cfg.log.format)
    try:
        config.check_host(cfg)
        handlers = registry.load_handlers(cfg.supervisor.handlers, generation=1)
    except ConfigError as exc:
        print(f"tangguh: error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    arbiter = Arbiter(cfg, handlers)
    try:
        return arbiter.run()
    except ConfigError as exc:  # found only at start (supervisor.socket_group): exit 2, no restart loop
        print(f"tangguh: error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except BrokerError as exc:
        print(f"tangguh: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
