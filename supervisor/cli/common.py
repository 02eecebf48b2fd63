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
