"""OpenTelemetry: one trace from a request span through enqueue to the handler's spans, across processes."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from supervisor import testing
from supervisor.backends import open_broker
from supervisor.tracing import trace_id_of

pytest.importorskip("opentelemetry.sdk")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# The producer: a web request's span, and inside it two enqueues; its spans are kept by the
# SDK's in-memory exporter and printed as JSON lines.
PRODUCER = """
import sys
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import supervisor

exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
trace.set_tracer_provider(provider)
supervisor.configure(url=sys.argv[1])
with trace.get_tracer("web").start_as_current_span("POST /checkout", kind=trace.SpanKind.SERVER):
    print(supervisor.JobRef("charge").enqueue({"order_id": 7}))
    print(supervisor.JobRef("refuse").enqueue({"order_id": 8}))
for span in exporter.get_finished_spans():
    print(span.to_json(indent=None))
"""


def spans_of(lines):
    return [json.loads(line) for line in lines if line.startswith("{")]


def by_name(spans):
    return {s["name"]: s for s in spans}


def test_one_trace_from_the_request_to_the_handler(tmp_path):
    handlers = tmp_path / "handlers"
    handlers.mkdir()
    shutil.copy(os.path.join(HERE, "handlers", "traced.py"), handlers)
    sup = testing.Supervisor(testing.write_config(str(tmp_path), str(handlers))).start()
    try:
        produced = subprocess.run([sys.executable, "-c", PRODUCER, sup.config.broker.url], capture_output=True,
                                  text=True, timeout=60, cwd=ROOT)
        assert produced.returncode == 0, produced.stderr
        charge_id, refuse_id, *_ = produced.stdout.split()
        charged, refused = sup.wait_job(charge_id), sup.wait_job(refuse_id)
    finally:
        sup.stop()
    assert (charged.state, refused.state, refused.reason) == ("done", "dead", "permanent")

    producer = by_name(spans_of(produced.stdout.splitlines()))
    request, enqueue = producer["POST /checkout"], producer["tangguh.enqueue charge"]
    trace_id = request["context"]["trace_id"]
    assert enqueue["parent_id"] == request["context"]["span_id"]
    assert enqueue["kind"] == "SpanKind.PRODUCER" and enqueue["attributes"]["tangguh.job.id"] == charge_id
    assert enqueue["context"]["trace_id"] == trace_id

    with open(tmp_path / "spans.jsonl") as f:
        child = by_name(spans_of(f))
    run, inner = child["tangguh.run charge"], child["charge card"]
    assert {run["context"]["trace_id"], inner["context"]["trace_id"]} == {trace_id}
    assert run["parent_id"] == enqueue["context"]["span_id"] and inner["parent_id"] == run["context"]["span_id"]
    assert run["kind"] == "SpanKind.CONSUMER"
    assert run["attributes"] == {"messaging.system": "tangguh", "messaging.operation.type": "process",
                                 "messaging.destination.name": "default", "tangguh.job.id": charge_id,
                                 "tangguh.job.type": "charge", "tangguh.job.attempt": 1, "tangguh.outcome": "ok"}
    failed = child["tangguh.run refuse"]
    assert failed["status"]["status_code"] == "ERROR" and failed["attributes"]["tangguh.outcome"] == "permanent"
    (event,) = failed["events"]
    assert (event["name"], event["attributes"]["exception.type"], event["attributes"]["exception.message"]) == (
        "exception", "Permanent", "card refused")
    assert failed["parent_id"] == producer["tangguh.enqueue refuse"]["context"]["span_id"]

    # The job carries the traceparent; every log record about it has the trace id, the master's too.
    assert trace_id_of(charged.trace_id) == trace_id[2:]
    records = [json.loads(line) for line in sup_logs(tmp_path) if line.startswith("{")]
    about = [r for r in records if r.get("job_id") == charge_id]
    assert {r["msg"] for r in about} >= {"charging"} and {r["trace_id"] for r in about} == {trace_id[2:]}


def sup_logs(tmp_path):
    with open(tmp_path / "supervisor.log") as f:
        return f.read().splitlines()


WORKFLOWS = """
import json, sys
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from supervisor.client import Client
from supervisor.tracing import trace_id_of

trace.set_tracer_provider(TracerProvider())
with Client.from_url(sys.argv[1]) as client:
    with trace.get_tracer("web").start_as_current_span("POST /month-end") as request:
        chain = client.chain([("a", {}), ("b", {}), ("c", {}, {"trace_id": "the-callers-own"})])
        flow = client.group([("a", {}), ("a", {})], then=("b", {}))
        batch = client.batch([("a", {})], on_success=("b", {}), on_complete=("c", {}))
        step = client.new_job("d", {})  # a trace id made here, then the caller's own
        step.trace_id = "set-after-a-check"
        (stored,) = client.store([step])
    ids = {"chain": chain[:2], "group": [*flow.ids, flow.then],
           "batch": [*batch.members, batch.on_success, batch.on_complete]}
    print(json.dumps({"request": format(request.get_span_context().trace_id, "032x"),
                      "traces": {what: [trace_id_of(client.get(i).trace_id) for i in job_ids]
                                 for what, job_ids in ids.items()},
                      "kept": [client.get(chain[2]).trace_id, client.get(stored).trace_id]}))
"""


def test_chains_groups_and_batches_carry_the_producers_trace(sqlite_url):
    out = subprocess.run([sys.executable, "-c", WORKFLOWS, sqlite_url], capture_output=True, text=True, timeout=60,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert seen["traces"] == {"chain": [seen["request"]] * 2, "group": [seen["request"]] * 3,
                              "batch": [seen["request"]] * 3}
    # A step's own trace_id is not replaced, even one set on a job after a check had made one.
    assert seen["kept"] == ["the-callers-own", "set-after-a-check"]


@pytest.mark.parametrize("blocked", [False, True])
def test_without_opentelemetry_nothing_changes(sqlite_url, blocked):
    # Installed but with no SDK configured, or not importable at all: the job keeps a random trace id.
    code = ("import sys\n" + ("sys.modules['opentelemetry'] = None\n" if blocked else "") +
            "from supervisor.client import Client\n"
            f"print(Client.from_url({sqlite_url!r}).enqueue('charge', {{}}))\n"
            "print(any(m.startswith('opentelemetry.sdk') for m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    job_id, sdk_loaded = out.stdout.split()
    with open_broker(sqlite_url) as broker:
        trace_id = broker.get(job_id).trace_id
    assert len(trace_id) == 32 and int(trace_id, 16) >= 0 and sdk_loaded == "False"


BAD_TYPES = """
import sys
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from supervisor.client import Client
from supervisor.errors import BadInput

trace.set_tracer_provider(TracerProvider())
client = Client.from_url(sys.argv[1])
for call in (lambda: client.enqueue(["charge"], {}), lambda: client.enqueue_many([("a", {}), (5, {})]),
             lambda: client.enqueue_many([("a", {}), ({"x": 1}, {})])):
    try:
        call()
    except BadInput as exc:
        print(exc)
"""


def test_a_bad_job_type_is_one_bad_input_line_with_tracing_on(sqlite_url):
    """With an SDK configured the enqueue's span sorted and hashed the types before they were
    checked: a list or dict as a type raised "unhashable type", a mix of types "'<' not
    supported", raw TypeErrors instead of the BadInput every other path gives."""
    out = subprocess.run([sys.executable, "-c", BAD_TYPES, sqlite_url], capture_output=True, text=True, timeout=60,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["job type must be a non-empty string"] + [
        "job 1: job type must be a non-empty string"] * 2
