"""Tangguh: a pre-fork worker-queue supervisor daemon.

Handler authors need only this module::

    import supervisor

    @supervisor.job("send_email", timeout=30)
    def send_email(ctx, payload):
        ...

Producers enqueue through the handler (``send_email.enqueue({...})``, with
``supervisor.configure(url=...)``), a ``supervisor.JobRef("send_email")``, or
a ``supervisor.Client``.
"""
from .errors import BadInput, BrokerError, ConfigError, LeaseLost, TangguhError  # noqa: F401
from .jobfilter import JobFilter  # noqa: F401
from .jobref import JobRef, configure  # noqa: F401
from .registry import job  # noqa: F401
from .retry import BadPayload, Permanent, RetryLater, Transient  # noqa: F401
from .child.timeouts import Cancelled, JobTimeout, critical  # noqa: F401
from .toolkit.locks import LockBusy, LockLost  # noqa: F401

__version__ = "0.1.0"


def __getattr__(name):
    # The client pulls in the brokers; handlers that never enqueue need not pay for it.
    if name == "Client":
        from .client import Client

        return Client
    raise AttributeError(f"module 'supervisor' has no attribute {name!r}")
