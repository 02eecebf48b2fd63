"""The supervisor's master process, one role per module; ``arbiter`` wires them (docs/design.md)."""
import signal
import sys

from .. import childlimits, config, logs, registry
from ..errors import BrokerError, ConfigError
from .arbiter import EXIT_BOOT, EXIT_CONFIG, EXIT_ERROR, EXIT_OK, EXIT_RUNNING, HELD_AT_START, Arbiter  # noqa: F401


def run(config_path=None):
    """``tangguh run``: load everything, then supervise until stopped. Returns the exit code."""
    signal.pthread_sigmask(signal.SIG_BLOCK, HELD_AT_START)  # a SIGHUP while the handlers import: a reload after
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
    del handlers  # the arbiter's until a reload replaces them: then nothing may hold them here
    try:
        return childlimits.leave(arbiter.run())
    except ConfigError as exc:  # found only at start (supervisor.socket_group): exit 2, no restart loop
        print(f"tangguh: error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except BrokerError as exc:
        print(f"tangguh: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
