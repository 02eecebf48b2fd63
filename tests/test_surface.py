"""What operators' dashboards, alerts and scripts read stays as recorded.

``status --json`` keys, the ``/metrics`` metric names and one job's log trail
(events and messages, enqueue -> claim -> start -> done -> acked) are compared
to tests/fixtures/surface.json. A change to any of them is a change to a
contract: record it on purpose with ``TANGGUH_RECORD_SURFACE=1`` and say so
in the changelog of that commit.
"""
import json
import logging
import os
import pathlib
import signal

from supervisor.client import Client

from .daemon import Daemon, tangguh

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "surface.json"


def shape(value):
    """The keys of a JSON value, recursively (lists by their first element); values dropped."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    return None


def metric_names(text):
    return sorted({line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")})


def test_status_keys_metric_names_and_a_jobs_log_trail_are_as_recorded(tmp_path, caplog):
    d = Daemon(tmp_path)
    try:
        d.start()
        with caplog.at_level(logging.DEBUG, logger="tangguh.client"), Client.from_url(d.broker_url) as client:
            job_id = client.enqueue("noop", {"i": 1})
            failing = client.enqueue("permanent", {})
        assert d.wait_job(job_id).state == "done"
        assert d.wait_job(failing).state == "dead"
        status = json.loads(tangguh("status", "--json", "-c", d.config_path).stdout)
        metrics = tangguh("metrics", "-c", d.config_path).stdout
        d.signal(signal.SIGTERM)
        assert d.wait_exit() == 0
    finally:
        d.stop()
    trail = [(r.event, r.getMessage()) for r in caplog.records if getattr(r, "job_id", None) == job_id]
    trail += [(record.get("event"), record.get("msg")) for record in d.records(job_id=job_id)]
    status["queues"] = {"default": status["queues"]["default"]}  # the queue's name is the test's own
    seen = {"status": shape(status), "metrics": metric_names(metrics),
            "trail": [[event, _generic(message)] for event, message in trail]}
    if os.environ.get("TANGGUH_RECORD_SURFACE") == "1":
        FIXTURE.parent.mkdir(exist_ok=True)
        FIXTURE.write_text(json.dumps(seen, indent=1, sort_keys=True) + "\n")
    recorded = json.loads(FIXTURE.read_text())
    assert seen["trail"] == recorded["trail"]
    assert seen["metrics"] == recorded["metrics"]
    assert seen["status"] == recorded["status"]


def _generic(message):
    """A log message with its numbers blanked (durations differ from run to run)."""
    import re

    return re.sub(r"\d+(\.\d+)?", "N", message or "")
