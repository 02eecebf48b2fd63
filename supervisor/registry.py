"""Handler discovery: the ``job`` decorator and loading handler files by path.

Each reload imports every ``*.py`` in the handlers folder afresh, as a new
module object named for its generation, so an edited file really changes
(``importlib.reload`` would keep stale globals, and a plain import would hit
``sys.modules``). Code outside the handlers folder changes only on restart.
"""
import dataclasses
import gc
import importlib.util
import inspect
import logging
import os
import sys
import traceback

from .errors import ConfigError, StopSignal, TangguhError
from .jsonvalues import clip_start

_MARK = "__tangguh_job__"
MAX_LOAD_ERROR = 2000  # characters of a handler file's exception kept: status and the log show it


@dataclasses.dataclass(frozen=True)
class HandlerSpec:
    type: str
    fn: object
    timeout: float | None = None
    soft_timeout: float | None = None
    max_attempts: int | None = None
    queue: str | None = None
    max_concurrency: int | None = None
    rate_limit: str | None = None
    exclusive: bool = False
    cron: str | None = None
    is_async: bool = False
    source: str = ""
    payload: object = None  # the payload schema (``supervisor.schemas``), or None for a plain dict


def job(type_name, *, timeout=None, soft_timeout=None, max_attempts=None, queue=None,
        max_concurrency=None, rate_limit=None, exclusive=False, cron=None, payload=None):
    """Mark ``fn(ctx, payload)`` as the handler of jobs of ``type_name``.

    Returns a ``jobref.Handler``: the function, still callable, with
    ``.enqueue(payload)`` and ``.enqueue_many(payloads)``. ``payload`` is a
    schema (a dataclass, a TypedDict, a pydantic model or a msgspec Struct):
    payloads are checked against it at enqueue and in the child, and the
    handler receives the typed object (``supervisor.schemas``).

    The keyword values are defaults; ``[jobs.types.<type_name>]`` in the
    config overrides them. Each is checked as that config key is (``ValueError``). ``max_concurrency``, ``rate_limit`` (``"100/m"``)
    and ``exclusive`` are enforced by the broker at claim time;
    ``cron`` enqueues a job of this type (payload ``{}``) at every tick, as a
    schedule named after the type (docs/scheduling.md).
    """
    if not isinstance(type_name, str) or not type_name.strip():
        raise ValueError("job type must be a non-empty string")
    from . import checks

    # The checks of the same keys in [jobs.types.<type>]: a timeout="30" taken as it was passed every
    # check and run_jobs, then killed the master (float + str) at the first job of the type.
    for key, value, check in (("timeout", timeout, checks.timeout_seconds),
                              ("soft_timeout", soft_timeout, checks.soft_timeout_seconds),
                              ("max_attempts", max_attempts, checks.positive_int),
                              ("queue", queue, checks.queue_name), ("exclusive", exclusive, checks.boolean),
                              ("max_concurrency", max_concurrency, checks.positive_int),
                              ("rate_limit", rate_limit, checks.rate), ("cron", cron, checks.cron)):
        if value is not None:
            try:
                check(value)
            except ValueError as exc:
                raise ValueError(f"job {type_name!r}: {key}: {exc}, got {value!r}") from None
    if payload is not None:
        from . import schemas

        try:
            schemas.kind_of(payload)
        except ValueError as exc:
            raise ValueError(f"job {type_name!r}: {exc}") from None

    def mark(fn):
        from .jobref import Handler

        handler = Handler(fn, type_name, payload=payload, queue=queue)
        setattr(handler, _MARK, dict(type=type_name, timeout=timeout, soft_timeout=soft_timeout,
                                     max_attempts=max_attempts, queue=queue, max_concurrency=max_concurrency,
                                     rate_limit=rate_limit, exclusive=bool(exclusive), cron=cron, payload=payload))
        return handler

    return mark


def handler_function(value):
    """What runs a job for ``value``, a marked object: the function under a ``Handler``, else
    ``value`` itself. Not ``__wrapped__``: a decorator put above ``@supervisor.job`` copies
    the mark with ``functools.wraps``, and the function under it skipped that decorator."""
    from .jobref import Handler

    return value.fn if isinstance(value, Handler) else value


class HandlerLoadError(ConfigError):
    """A handler file failed to import, or two handlers claim one type."""


def _where(spec):
    """``/srv/handlers/billing.py:12 (charge)``: a handler's file, the line of its definition, its name."""
    try:
        fn = inspect.unwrap(spec.fn)
    except ValueError:  # a __wrapped__ cycle
        fn = spec.fn
    code = getattr(fn, "__code__", None)
    line = f":{code.co_firstlineno}" if code is not None else ""
    return f"{spec.source}{line} ({getattr(fn, '__qualname__', fn)})"


def load_handlers(folder, generation=0, importer=None):
    """Import every ``*.py`` in ``folder``; return ``{type: HandlerSpec}``.

    ``importer(path, module_name)`` returns a file's module (default: a fresh import).
    """
    if not os.path.isdir(folder):
        raise HandlerLoadError(f"supervisor.handlers: {folder} is not a folder")
    handlers = {}
    for filename in sorted(os.listdir(folder)):
        if not filename.endswith(".py") or filename.startswith((".", "_")):
            continue
        path = os.path.join(folder, filename)
        module = (importer or _import_path)(path, f"tangguh_handlers.g{generation}.{filename[:-3]}")
        seen = set()
        for name, value in list(vars(module).items()):
            try:
                meta = getattr(value, _MARK, None)
            except Exception:  # noqa: BLE001 - a lazy proxy (Django's settings, a werkzeug LocalProxy): not ours
                continue
            if meta is None or id(value) in seen or not callable(value):
                continue
            seen.add(id(value))
            fn = handler_function(value)
            try:
                spec = HandlerSpec(fn=fn, is_async=inspect.iscoroutinefunction(fn), source=path, **meta)
            except TypeError as exc:
                raise HandlerLoadError(f"{path}: {name} is marked as a handler but is not one made by"
                                       f" @supervisor.job ({exc})") from None
            if spec.is_async:
                import asyncio  # noqa: F401 - loaded here, before the fork, so children share it
            other = handlers.get(spec.type)
            if other is not None and other.fn is not fn:
                raise HandlerLoadError(f"job type {spec.type!r} has two handlers: {_where(other)} and {_where(spec)}")
            handlers[spec.type] = spec
    return handlers


def reload_handlers(folder, generation, current):
    """The next generation's handlers, and the job types it no longer serves. A folder with none
    while ``current`` serves some is refused: a deploy caught halfway would dead-letter every job."""
    handlers = load_handlers(folder, generation)
    if current and not handlers:
        raise HandlerLoadError(f"supervisor.handlers: {folder} holds no job handler now; keeping the"
                               f" {len(current)} job types loaded")
    return handlers, sorted(set(current) - set(handlers))


def reload_error_text(exc):
    """What ``status`` and the log say of a failed reload (a handler file's error is cut: ``_describe``)."""
    return str(exc) if isinstance(exc, TangguhError) else f"{type(exc).__name__}: {exc}"


def dropped_note(dropped):
    """The reload log's note on the job types a new generation no longer serves ('' for none)."""
    if not dropped:
        return ""
    return f"; no longer serves {', '.join(dropped[:20])}{' and more' if len(dropped) > 20 else ''}" \
           " (their jobs claimed here are dead-lettered: unknown_type)"


def forget_generation(generation):
    """Drop a past generation's handler modules from ``sys.modules`` (and the loggers they named
    after themselves), and with them (once nothing else holds them) everything they built at
    import. Children forked with them keep their own copies."""
    prefix = f"tangguh_handlers.g{generation}."
    for name in [name for name in sys.modules if name.startswith(prefix)]:
        del sys.modules[name]
    loggers = logging.Logger.manager.loggerDict  # getLogger(__name__): one per module per reload
    for name in [name for name in loggers if name.startswith(prefix) or name == prefix[:-1]]:
        loggers.pop(name, None)
    gc.collect()  # a module and its functions are a cycle: an idle master may not collect it for hours


def _import_path(path, module_name):
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses, pickle and friends look modules up here
    pid = os.getpid()
    try:
        spec.loader.exec_module(module)
    except StopSignal:  # a stop while the master starts: not the file's failure (exit 2), a stop
        sys.modules.pop(module_name, None)
        raise
    except BaseException as exc:  # noqa: BLE001 - any failure of a handler file is a load error
        sys.modules.pop(module_name, None)
        raise HandlerLoadError(_describe(path, exc)) from None
    finally:
        if os.getpid() != pid:
            # A process the module forked at import came back here: it would run on as a second
            # master, on our socket, signals and broker.
            os._exit(0)
    return module


def _describe(path, exc):
    """``handlers/x.py:12: SyntaxError: invalid syntax`` - file and line of the failure."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return f"{exc.filename}:{exc.lineno}: SyntaxError: {exc.msg}"
    line = "?"
    for frame in traceback.extract_tb(exc.__traceback__):
        if os.path.abspath(frame.filename) == os.path.abspath(path):
            line = frame.lineno
    try:
        text = str(exc)
    except BaseException:  # noqa: BLE001 - an exception whose __str__ fails still names its file
        text = f"<unprintable {type(exc).__name__}>"
    return f"{path}:{line}: {type(exc).__name__}: {clip_start(text, MAX_LOAD_ERROR)}"


def first(*values):
    """The first value that is set: the precedence rule of every per-type setting."""
    return next((v for v in values if v is not None), None)


@dataclasses.dataclass(frozen=True)
class JobSettings:
    """The rules one attempt runs under, fixed when it is claimed (a reload mid-job changes nothing)."""

    timeout: float
    soft_timeout: float | None
    max_attempts: int


def job_settings(cfg, handlers, job):
    """``[jobs.types.<t>]`` over the decorator over the job's own values over ``[jobs]``."""
    spec, override = handlers.get(job.type), cfg.job_type(job.type)
    timeout = first(job.timeout, override.timeout, spec and spec.timeout, cfg.jobs.timeout)
    soft = first(override.soft_timeout, spec and spec.soft_timeout, cfg.jobs.soft_timeout)
    attempts = first(override.max_attempts, spec and spec.max_attempts, job.max_attempts)
    return JobSettings(timeout, soft or None, attempts)


def type_limits(cfg, handlers):
    """``{type: TypeLimits}`` for every type with a claim limit: ``[jobs.types.<t>]`` over the decorator."""
    from .model import TypeLimits, parse_rate

    out = {}
    for type_name in sorted(set(handlers) | set(cfg.jobs.types)):
        spec, override = handlers.get(type_name), cfg.job_type(type_name)
        concurrency = first(override.max_concurrency, spec and spec.max_concurrency)
        rate = first(override.rate_limit, spec and spec.rate_limit)
        exclusive = first(override.exclusive, spec and spec.exclusive)
        limits = TypeLimits(concurrency, parse_rate(rate) if rate else None, bool(exclusive))
        if limits:
            out[type_name] = limits
    return out
