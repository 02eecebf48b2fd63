"""Handlers for the tracing test. The child's spans go to ``spans.jsonl`` beside the handlers folder.

A SimpleSpanProcessor exports as each span ends, from the process that ran
it, and starts no thread in the master (which must fork with no other thread).
"""
import json
import os

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

import supervisor

SPANS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "spans.jsonl")


class JsonLinesExporter(SpanExporter):
    def export(self, spans):
        with open(SPANS, "a") as f:
            for span in spans:
                f.write(span.to_json(indent=None) + "\n")
        return SpanExportResult.SUCCESS


if not isinstance(trace.get_tracer_provider(), TracerProvider):
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(JsonLinesExporter()))
    trace.set_tracer_provider(provider)


@supervisor.job("charge")
def charge(ctx, payload):
    with trace.get_tracer("shop").start_as_current_span("charge card"):
        ctx.log.info("charging")
    return {"charged": payload["order_id"]}


@supervisor.job("refuse")
def refuse(ctx, payload):
    raise supervisor.Permanent("card refused")
