"""The supervisor's master process, one role per module; ``arbiter`` wires them (docs/design.md)."""
import signal
import sys

from .. import childlimits, config, logs, registry, scheduler
from ..errors import BrokerError, ConfigError
from .arbiter import EXIT_BOOT, EXIT_CONFIG, EXIT_ERROR, EXIT_OK, EXIT_RUNNING, Arbiter, held  # noqa: F401

HELD_AT_START = (signal.SIGHUP, signal.SIGTTIN, signal.SIGTTOU)  # their default ends us: noted until start()


def run(config_path=None):
    """``tangguh run``: load everything, then supervise until stopped. Returns the exit code."""
    for sig in HELD_AT_START:
        # A SIGHUP while the handlers import (logrotate, a deploy script) is a reload once up.
        # Noted, not blocked: a blocked signal stays blocked in every program a module starts.
        signal.signal(sig, lambda signum, _frame: held.append(signum))
    try:
        cfg = config.load(config_path)
    except ConfigError as exc:
        print(f"tangguh: error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    logs.setup(cfg.log.level, cfg.log.format)
    # Every way out once handler modules ran: a thread one started must not keep us alive.
    return childlimits.leave(_supervise(cfg))


def _supervise(cfg):
    try:
        config.check_host(cfg)
        handlers = registry.load_handlers(cfg.supervisor.handlers, generation=1)
        scheduler.check_schedules(cfg, handlers)  # a schedule none of whose ticks could run
    except ConfigError as exc:
        print(f"tangguh: error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    arbiter = Arbiter(cfg, handlers)
    del handlers  # the arbiter's until a reload replaces them: then nothing may hold them here
    try:
        return arbiter.run()
    except ConfigError as exc:  # found only at start (supervisor.socket_group): exit 2, no restart loop
        print(f"tangguh: error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except BrokerError as exc:
        print(f"tangguh: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
