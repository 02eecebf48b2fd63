"""Log formatting: JSON lines carry a job's ids; under journald each line carries its priority."""
import json
import logging
import os
import signal

import pytest

from supervisor import logs


@pytest.fixture(autouse=True)
def restore_root_logger():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def _logger(stream, fmt, env):
    os.environ.pop("JOURNAL_STREAM", None)
    os.environ.update(env)
    try:
        logs.setup("debug", fmt, stream)
    finally:
        os.environ.pop("JOURNAL_STREAM", None)
    return logging.getLogger("tangguh.test")


def test_lines_to_the_journal_carry_their_syslog_priority(tmp_path):
    path = tmp_path / "journal"
    with open(path, "w") as stream:
        st = os.fstat(stream.fileno())
        log = _logger(stream, "json", {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"})
        log.warning("lease lost", extra=logs.job_fields({"id": "job_1", "type": "t", "attempt": 2}))
        log.info("job done")
        log.error("broker unreachable")
    lines = path.read_text().splitlines()
    assert [line[:3] for line in lines] == ["<4>", "<6>", "<3>"]
    record = json.loads(lines[0][3:])
    assert (record["job_id"], record["type"], record["attempt"]) == ("job_1", "t", 2)


def test_no_prefix_when_stderr_is_not_the_journal(tmp_path):
    with open(tmp_path / "a", "w") as stream, open(tmp_path / "b", "w") as other:
        st = os.fstat(other.fileno())  # JOURNAL_STREAM names another file: not ours
        log = _logger(stream, "text", {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"})
        log.warning("plain")
    assert not (tmp_path / "a").read_text().startswith("<")


def test_one_job_can_be_followed_from_enqueue_to_ack(tmp_path, caplog):
    """The producer's record, then the supervisor's: every one carries the same ids."""

    from supervisor.client import Client
    from supervisor.tracing import log_trace_id

    from .daemon import Daemon

    d = Daemon(tmp_path)
    try:
        d.start()
        with caplog.at_level(logging.DEBUG, logger="tangguh.client"), Client.from_url(d.broker_url) as client:
            job_id = client.enqueue("noop", {"i": 1}, resource_id="order:7", idempotency_key="receipt:7")
            again = client.enqueue("noop", {"i": 1}, idempotency_key="receipt:7")
        assert d.wait_job(job_id).state == "done"
        produced = [r for r in caplog.records if getattr(r, "job_id", None) == job_id]
        assert [(r.event, r.getMessage()) for r in produced] == [
            ("enqueue", "job enqueued"), ("enqueue", "job enqueued (deduplicated)")]
        assert again == job_id
        # A traceparent (stored when an OpenTelemetry provider is set in this process: a test
        # module of the same worker may have set one) logs as its trace id.
        trace_id = log_trace_id(d.job(job_id).trace_id)
        assert produced[0].trace_id == trace_id
        assert (produced[0].type, produced[0].queue, produced[0].resource_id) == ("noop", "default", "order:7")

        d.signal(signal.SIGTERM)
        assert d.wait_exit() == 0
        supervised = d.records(job_id=job_id)
        assert [r["event"] for r in supervised] == ["claim", "start", "done", "acked"]
        assert {(r["trace_id"], r["idempotency_key"], r["resource_id"]) for r in supervised} == {
            (trace_id, "receipt:7", "order:7")}
        d.assert_clean()
    finally:
        d.stop()
