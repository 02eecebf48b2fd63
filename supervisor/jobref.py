"""Enqueue through the handler: ``send_receipt.enqueue({...})`` instead of a type name in a string.

``@supervisor.job("send_receipt")`` returns a ``Handler``: it still calls the
function, and it enqueues jobs of its type through a client. Producers that
must not import handler code use ``JobRef("send_receipt")``, the same methods
without the function.

The client is the one passed as ``client=``, else the default client of this
process: ``supervisor.configure(url=...)`` or ``configure(config=...)``, else
the ``TANGGUH_CONFIG`` (a config file) or ``TANGGUH_BROKER_URL`` environment
variable. One made from a URL or config is one per thread and one per process
(a forked child never writes through its parent's connection), so threads
never take turns on a connection; a client given to ``configure(client=...)``
is that one client in every thread (``Client`` is thread-safe: calls take
turns) and process.
"""
import functools
import os
import threading

from .errors import ConfigError

_settings = None  # what ``configure`` was given: ("url", url), ("config", cfg or path) or ("client", client)
_local = threading.local()

NO_CLIENT = ("no default client to enqueue with: call supervisor.configure(url=...) or "
             "supervisor.configure(config=...), set TANGGUH_CONFIG or TANGGUH_BROKER_URL, or pass client=")


def configure(url=None, *, config=None, client=None):
    """Set the default client of this process: a broker ``url``, a ``config`` (a path or a loaded
    ``config.Config``), or a ready ``client``. ``configure()`` with nothing forgets it."""
    global _settings
    given = [(k, v) for k, v in (("url", url), ("config", config), ("client", client)) if v is not None]
    if len(given) > 1:
        raise ValueError("supervisor.configure: give one of url=, config= or client=")
    _settings = given[0] if given else None
    _local.__dict__.clear()


def configure_unless_set(config):
    """Make ``config`` the default unless ``configure`` or the environment already chose one.

    A supervisor's child calls this, so a handler's follow-up ``.enqueue()``
    goes to the broker the handler was claimed from.
    """
    if _settings is None and _from_environment() is None:
        configure(config=config)


def save():
    """What ``configure`` was last given (for ``restore``: a test fixture's teardown)."""
    return _settings


def restore(saved):
    global _settings
    _settings = saved
    _local.__dict__.clear()


def default_client():
    """The client ``Handler.enqueue`` uses when none is passed (raises ``ConfigError`` when none is set)."""
    setting = _settings or _from_environment()
    if setting is None:
        raise ConfigError(NO_CLIENT)
    kind, value = setting
    if kind == "client":
        return value
    cached = getattr(_local, "client", None)
    if cached is not None and _local.pid == os.getpid() and _local.setting == setting:
        return cached
    from .client import Client

    client = Client.from_url(value) if kind == "url" else Client.from_config(value)
    _local.client, _local.pid, _local.setting = client, os.getpid(), setting
    return client


def _from_environment():
    if os.environ.get("TANGGUH_CONFIG"):
        return ("config", os.environ["TANGGUH_CONFIG"])
    if os.environ.get("TANGGUH_BROKER_URL"):
        return ("url", os.environ["TANGGUH_BROKER_URL"])
    return None


def job_args(client, type, payload, queue):
    """``(type, payload, queue)`` for ``Client.new_job``: a handler or ``JobRef`` given as the type
    (``client.enqueue(send_receipt, ...)``, a workflow's step) is its type name, its payload checked
    against its schema and its decorator's queue applied, as its own ``.enqueue`` does."""
    if not isinstance(type, JobRef):
        return type, payload, queue
    return type.type, type.payload_of(payload), type._options(client, {"queue": queue}).get("queue")


def type_name(type):
    """A job type as a span names it: a handler's or ``JobRef``'s own type."""
    return type.type if isinstance(type, JobRef) else type


class JobRef:
    """A job type to enqueue: ``JobRef("send_receipt").enqueue({"order_id": 7})``."""

    def __init__(self, type_name, *, payload=None, queue=None):
        if not isinstance(type_name, str) or not type_name.strip():
            raise ValueError("job type must be a non-empty string")
        if payload is not None:  # here, not at every enqueue (a ValueError there, where BadInput is caught)
            from . import schemas

            try:
                schemas.kind_of(payload)
            except ValueError as exc:
                raise ValueError(f"job {type_name!r}: {exc}") from None
        self.type = type_name
        self.payload_schema = payload
        self.queue = queue

    def __repr__(self):
        return f"<{type(self).__name__} {self.type!r}>"

    def enqueue(self, payload, *, client=None, **options):
        """Store one job of this type; return its id. ``options`` are ``Client.enqueue``'s
        (``idempotency_key``, ``resource_id``, ``delay``, ``queue``, ``conn``...)."""
        client = client or default_client()
        return client.enqueue(self.type, self.payload_of(payload), **self._options(client, options))

    def enqueue_many(self, payloads, *, client=None, **options):
        """Store one job per payload in one round trip; ``options`` apply to each (so an
        ``idempotency_key``, which would make them one job, only with one payload). All are checked first."""
        from .client import JOB_OPTIONS
        from .errors import BadInput

        client = client or default_client()
        job_options = self._options(client, {k: v for k, v in options.items() if k in JOB_OPTIONS})
        broker_kwargs = {k: v for k, v in options.items() if k not in JOB_OPTIONS}
        items = []
        for i, payload in enumerate(payloads):
            try:
                items.append((self.type, self.payload_of(payload), job_options))
            except BadInput as exc:
                raise BadInput(f"job {i}: {exc}") from None
        if len(items) > 1 and job_options.get("idempotency_key") is not None:
            # Applied to each, one key makes the batch one job: the others deduplicated into it.
            raise BadInput(f"idempotency_key= would make the {len(items)} jobs one (each is deduplicated into the"
                           " first): give each job its own key with Client.enqueue_many")
        return client.enqueue_many(items, **broker_kwargs)

    def payload_of(self, payload):
        """The JSON payload to store (checked against the schema, if any; raises ``BadInput``)."""
        if self.payload_schema is None:
            return payload
        from . import schemas

        return schemas.dump(self.payload_schema, payload)

    def _options(self, client, options):
        # The decorator's queue applies unless the call or the config's [jobs.types.<type>] names one.
        if self.queue is not None and options.get("queue") is None:
            override = client.config.job_type(self.type).queue if client.config is not None else None
            options = dict(options, queue=override or self.queue)
        return options


class Handler(JobRef):
    """What ``@supervisor.job`` returns: the handler function, callable as before, that also enqueues."""

    def __init__(self, fn, type_name, *, payload=None, queue=None):
        super().__init__(type_name, payload=payload, queue=queue)
        self.fn = fn
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)
