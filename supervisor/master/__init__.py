"""The supervisor's master process, one role per module; ``arbiter`` wires them (docs/design.md)."""
import logging
import os
import signal
import sys

from .. import childlimits, config, logs, registry, scheduler
from ..errors import BrokerError, ConfigError, StopSignal
from . import trial
from .arbiter import EXIT_BOOT, EXIT_CONFIG, EXIT_ERROR, EXIT_OK, EXIT_RUNNING, Arbiter, held  # noqa: F401

HELD_AT_START = (signal.SIGHUP, signal.SIGTTIN, signal.SIGTTOU)  # their default ends us: noted until start()
STOPS = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT)

log = logging.getLogger("tangguh.arbiter")


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
    for sig in STOPS:
        # While the handler files import no job runs yet: a stop (any of them) ends the import and
        # the start at once. Their defaults ended us by the signal, and SIGINT as a traceback or a
        # handler file's load error (exit 2).
        signal.signal(sig, _stop_at_start)
    # Every way out once handler modules ran: a thread one started must not keep us alive.
    return childlimits.leave(_supervise(cfg))


def _supervise(cfg):
    try:
        config.check_host(cfg)
        _trial_import(cfg)
        handlers = registry.load_handlers(cfg.supervisor.handlers, generation=1)
        scheduler.check_schedules(cfg, handlers)  # a schedule none of whose ticks could run
        for sig in STOPS:  # from here until the loop: noted, then a stop as the running master makes
            signal.signal(sig, lambda signum, _frame: held.append(signum))
    except ConfigError as exc:
        print(f"tangguh: error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except StopSignal as stop:  # the trial (killed by its wait) and the master's own import given up
        log.info("supervisor stopped by %s during start-up (importing the handler files), before any job ran",
                 signal.Signals(stop.signum).name, extra={"event": "stop", "pid": os.getpid(), "exit_code": EXIT_OK})
        return EXIT_OK
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


def _stop_at_start(signum, _frame):
    raise StopSignal(signum)


def _trial_import(cfg):
    """The handler files imported first in a throwaway process, as a reload imports them: a
    module that ended the process importing it (``os._exit(0)``) ended ``run`` with status 0,
    which systemd's ``Restart=on-failure`` takes for a clean stop, and one that waited at import
    held the start for ever. Either is now a start-up error (exit 2), within ``import_timeout``."""
    if not os.path.isdir(cfg.supervisor.handlers):
        return  # the folder's own error comes from the import itself
    problem = trial.trial(cfg.supervisor.handlers, 1, None, cfg.supervisor.import_timeout)
    if problem:
        raise ConfigError(problem)
