"""OpenTelemetry traces, when the application has OpenTelemetry (``pip install tangguh[otel]``).

The producer's enqueue runs in a span ``tangguh.enqueue <type>`` and stores
that span's W3C ``traceparent`` as the job's ``trace_id`` (the field every
broker already keeps; the ``tracestate`` is not carried). The child runs the
handler in a span ``tangguh.run <type>``, a child of it, so one trace goes
from the request that enqueued the job to the handler's own spans, across
processes. Log records carry the trace id part (``trace_id_of``), so logs
and traces join.

Without OpenTelemetry, or with its API but no SDK configured, nothing here
costs more than one failed import per process: the job keeps its random
trace id, as before.
"""
import contextlib
import re

_TRACEPARENT = re.compile(r"[0-9a-f]{2}-([0-9a-f]{32})-[0-9a-f]{16}-[0-9a-f]{2}")
_api = None  # the opentelemetry.trace module, False when it is not installed, None before the first look


def _trace():
    global _api
    if _api is None:
        try:
            from opentelemetry import trace
        except ImportError:
            trace = False
        _api = trace
    return _api


def trace_id_of(stored):
    """The trace id to log for a job's stored ``trace_id``: the middle of a traceparent, else as stored."""
    match = _TRACEPARENT.fullmatch(stored) if isinstance(stored, str) else None
    return match.group(1) if match else stored


class _Enqueue:
    """The producer's span, as ``enqueue_span`` yields it."""

    traceparent = None  # the W3C traceparent to store as the job's trace_id; None without a recording span

    def __init__(self, span=None):
        self.span = span

    def stored(self, job_ids):
        if self.span is not None and job_ids:
            self.span.set_attribute("tangguh.job.id", job_ids[0] if len(job_ids) == 1 else ",".join(job_ids[:10]))
            self.span.set_attribute("tangguh.job.count", len(job_ids))


class _Untraced(_Enqueue):
    """An enqueue that is not traced: its own context manager (no generator to run), holding no state."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_NOTHING = _Untraced()


def _no_sdk(trace):
    """The tracer providers of the API alone: the proxy before an SDK is set, the no-op one."""
    return trace.ProxyTracerProvider, trace.NoOpTracerProvider


def enqueue_span(type_names, queue=None):
    """``with enqueue_span(["send_receipt"]) as span``: store ``span.traceparent`` with the job(s)."""
    trace = _trace()
    if not trace or (isinstance(trace.get_tracer_provider(), _no_sdk(trace))
                     and not trace.get_current_span().get_span_context().is_valid):
        # No OpenTelemetry, or its API without an SDK and no incoming trace: the span would record
        # nothing and carry no traceparent, and making it costs more than the rest of an enqueue.
        return _NOTHING
    return _traced(trace, type_names, queue)


@contextlib.contextmanager
def _traced(trace, type_names, queue):
    # The types are not checked yet (that is the enqueue's, inside this span): one that is no
    # string (a list, a dict) is no name, and failed here as a raw TypeError, not BadInput.
    names = sorted({t for t in type_names if isinstance(t, str)})
    name = f"tangguh.enqueue {names[0]}" if len(names) == 1 else "tangguh.enqueue"
    attributes = {"messaging.system": "tangguh", "messaging.operation.type": "send", "tangguh.job.type": names}
    if queue:
        attributes["messaging.destination.name"] = queue
    with trace.get_tracer("tangguh").start_as_current_span(name, kind=trace.SpanKind.PRODUCER,
                                                           attributes=attributes) as span:
        handle = _Enqueue(span)
        if span.get_span_context().is_valid:
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

            carrier = {}
            TraceContextTextMapPropagator().inject(carrier)
            handle.traceparent = carrier.get("traceparent")
        yield handle


def run_span(job, run):
    """``run()`` (the child's ``run_job``) inside a span ``tangguh.run <type>``, a child of the
    producer's span when the job carries its traceparent. Returns ``run()``'s reply."""
    trace = _trace()
    if not trace or (isinstance(trace.get_tracer_provider(), _no_sdk(trace))
                     and not (isinstance(job.get("trace_id"), str) and _TRACEPARENT.fullmatch(job["trace_id"]))):
        # As for an enqueue: without an SDK and without a producer's trace to carry on to
        # the handler's own enqueues, the span would record and pass on nothing, and making
        # it cost more than the rest of the child's work per job.
        return run()
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    from opentelemetry.trace.status import Status, StatusCode

    parent = TraceContextTextMapPropagator().extract({"traceparent": str(job.get("trace_id") or "")})
    attributes = {"messaging.system": "tangguh", "messaging.operation.type": "process",
                  "messaging.destination.name": str(job.get("queue")), "tangguh.job.id": str(job.get("id")),
                  "tangguh.job.type": str(job.get("type")), "tangguh.job.attempt": int(job.get("attempt") or 0)}
    with trace.get_tracer("tangguh").start_as_current_span(
            f"tangguh.run {job.get('type')}", context=parent, kind=trace.SpanKind.CONSUMER, attributes=attributes,
            record_exception=False, set_status_on_exception=False) as span:
        reply = run()
        span.set_attribute("tangguh.outcome", "ok" if reply.get("ok") else str(reply.get("kind")))
        if not reply.get("ok"):
            # run_job has caught the exception already: record it as record_exception would.
            span.add_event("exception", {"exception.type": str(reply.get("error_class", "")),
                                         "exception.message": str(reply.get("message", "")),
                                         "exception.stacktrace": str(reply.get("traceback", ""))})
            span.set_status(Status(StatusCode.ERROR, str(reply.get("message", ""))))
    return reply


def log_trace_id(stored):
    """The ``trace_id`` of a log record: the active span's trace id, else the job's (``trace_id_of``).
    Never imports OpenTelemetry itself: only a process that traced already looks for a span."""
    if _api:
        context = _api.get_current_span().get_span_context()
        if context.is_valid:
            return _api.format_trace_id(context.trace_id)
    return trace_id_of(stored)
