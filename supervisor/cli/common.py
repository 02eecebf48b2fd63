"""What every command shares: the two failures, the config, the client, the daemon's modules."""
import importlib
import os

from .. import config as config_module
from ..errors import ConfigError

PROG = "tangguh"
DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")  # shipped in the package


class UsageError(Exception):
    """Bad command line: exit 2."""


class Failure(Exception):
    """A runtime failure already phrased for the operator: exit 1."""


CLOSED_AT_START = set()  # "stdout", "stderr": closed by the caller (`>&-`), written to /dev/null


def config_path(args):
    """The config file of a command that acts; without one (none given, none at the default
    paths) it refuses. Built-in defaults there meant a new ./tangguh.db in whatever folder
    the operator stood in: an empty queue shown, jobs enqueued that no supervisor reads."""
    found = config_module.find_config(args.config)
    if found is None:
        raise ConfigError(f"no config file ({' or '.join(config_module.DEFAULT_PATHS)}): pass -c PATH"
                          f" (`{PROG} config init` writes one)")
    return found


def load_config(args):
    return config_module.load(config_path(args))


def open_client(args, cfg=None):
    from ..client import Client

    return Client.from_config(cfg or load_config(args))


def daemon_module(name):
    """Import ``supervisor.<name>`` on demand (the producer commands never load the daemon)."""
    try:
        return importlib.import_module(f"supervisor.{name}")
    except ImportError as exc:
        raise Failure(f"this installation has no supervisor.{name} ({exc})") from None


def import_handlers(cfg):
    """The handlers of ``cfg``'s folder, imported in this process as ``run`` imports them: once a
    trial import in a throwaway process passed within ``supervisor.import_timeout`` (a module
    that exits or hangs at import would end the command with status 0, nothing done, or hang
    it), and with what they print sent to stderr (``id=$(tangguh enqueue ...)`` reads stdout).
    Raises ``registry.HandlerLoadError``."""
    import contextlib
    import sys
    import threading

    from .. import registry
    from ..master import trial

    if not os.path.isdir(cfg.supervisor.handlers):
        return registry.load_handlers(cfg.supervisor.handlers)  # the folder's own error, no process
    sys.stdout.flush()
    stdout = os.dup(1)
    os.dup2(2, 1)  # the trial process's stdout too
    try:
        problem = trial.trial(cfg.supervisor.handlers, 0, None, cfg.supervisor.import_timeout)
    finally:
        os.dup2(stdout, 1)
        os.close(stdout)
    if problem:
        raise registry.HandlerLoadError(problem)
    before = set(threading.enumerate())
    try:
        with contextlib.redirect_stdout(sys.stderr):
            return registry.load_handlers(cfg.supervisor.handlers)
    finally:  # not waited for at exit, as the daemon does not wait for them (main)
        HANDLER_THREADS.extend(t for t in threading.enumerate() if t not in before and not t.daemon)


HANDLER_THREADS = []  # the threads handler modules started at import, without daemon=True


def job_id(text):
    """An ``ID`` argument (argparse ``type``): what a job id can be. A byte the shell passed that
    is no UTF-8 (a lone surrogate here) reached the broker, which failed with an internal error."""
    import argparse

    from ..backends.control import check_ids
    from ..errors import BadInput

    try:
        return check_ids([text])[0]
    except BadInput as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
