"""Workflows with real supervisors: a chain passing results, a fan-in that survives a SIGKILL, replay.

Every handler writes a line to a marker file (``tests/handlers/flows.py``); a
callback's line is its effect, which must happen exactly once.
"""
import os
import signal

import pytest

from supervisor.client import Client

from .daemon import Daemon, read_lines, tangguh
from .util import wait_for

FLOWS = ("flows.py",)


def callbacks(marker):
    return [line for line in read_lines(marker) if line[0] == "callback"]


def test_a_chain_runs_step_by_step_passing_each_result(tmp_path):
    d = Daemon(tmp_path, handler_files=FLOWS)
    marker = str(tmp_path / "marker")
    try:
        d.start()
        with Client.from_url(d.broker_url) as client:
            ids = client.chain([("flow_add", {"n": n, "marker": marker}) for n in (1, 10, 100)])
        assert d.wait_job(ids[-1]).result == 111
        # Each step ran once, in order, and saw the sum so far.
        assert read_lines(marker) == [["step", ids[0], "0"], ["step", ids[1], "1"], ["step", ids[2], "11"]]
        d.signal(signal.SIGTERM)
        assert d.wait_exit() == 0
        d.assert_clean()
    finally:
        d.stop()


@pytest.mark.parametrize("kind", ["sqlite", "redis", "postgres"])
def test_a_group_callback_runs_once_though_a_supervisor_is_killed_mid_fan_in(kind, request, tmp_path):
    url = request.getfixturevalue(f"{kind}_url")
    sections = dict(supervisor={"workers": 2}, broker={"lease_seconds": 2.0, "heartbeat_seconds": 0.3},
                    log={"level": "warning"})
    a = Daemon(tmp_path / "a", broker_url=url, handler_files=FLOWS, **sections)
    b = Daemon(tmp_path / "b", broker_url=url, handler_files=FLOWS, **sections)
    marker, release = str(tmp_path / "marker"), str(tmp_path / "release")
    members, quick = 12, 4
    try:
        a.start()
        a_pids = set(a.worker_pids())
        with Client.from_url(url) as client:
            # The quick members run first and finish at once; the others hold until the release file exists.
            flow = client.group([("flow_member", {"i": i, "marker": marker, "release": release}, {"priority": 0})
                                 if i >= quick else ("flow_member", {"i": i, "marker": marker}, {"priority": 1})
                                 for i in range(members)], then=("flow_callback", {"marker": marker}))
        wait_for(lambda: sum(1 for m in flow.ids if a.job(m).state == "done") >= quick
                 and len(read_lines(marker)) >= quick + len(a_pids), message="a to finish some members, hold two")
        a.kill_group()  # SIGKILL mid-fan-in, master and children: a's leases come back when they expire
        b.start(wait=False)
        open(release, "w").close()
        done = b.wait_job(flow.then, timeout=60)
        assert done.state == "done" and done.result == members
        (line,) = callbacks(marker)  # the effect happened once
        assert line[1:] == [flow.then, str(members), "done", str(sum(range(members)))]
        jobs = [b.job(m) for m in flow.ids]
        assert all(job.state == "done" for job in jobs)
        assert any(h.get("outcome") == "lease_expired" for job in jobs for h in job.history), "a died holding members"
        assert b.job(flow.then).attempt == 1
        wait_for(b.ready, timeout=30, message="b to be up")
        b.signal(signal.SIGTERM)
        assert b.wait_exit() == 0
        b.assert_clean()
    finally:
        open(release, "w").close()
        a.stop()
        b.stop()


def test_replaying_a_dead_member_fires_the_callback_once_after_it(tmp_path):
    d = Daemon(tmp_path, handler_files=FLOWS)
    marker, fixed = str(tmp_path / "marker"), str(tmp_path / "fixed")
    try:
        d.start()
        with Client.from_url(d.broker_url) as client:
            batch = client.batch(
                [("flow_member", {"i": i, "marker": marker, **({"fail_until": fixed} if i == 2 else {})})
                 for i in range(4)],
                on_success=("flow_callback", {"marker": marker}))
        dead = d.wait_job(batch.members[2], states=("dead",))
        assert d.wait_job(batch.on_success, states=("cancelled",)).reason == "parent_failed"
        shown = tangguh("batch", batch.id, "-c", d.config_path)
        assert shown.returncode == 0, shown.stderr
        assert "dead:             1" in shown.stdout and "done:             3" in shown.stdout
        assert callbacks(marker) == []
        open(fixed, "w").close()
        replayed = tangguh("dlq", "replay", dead.id, "-c", d.config_path)
        assert replayed.returncode == 0, replayed.stderr
        assert d.wait_job(batch.on_success).state == "done"
        (line,) = callbacks(marker)
        assert line[2:] == ["4", "done", "6"]
        shown = tangguh("job", batch.on_success, "-c", d.config_path)
        assert "depends_on:       4 job(s): 4 done" in shown.stdout, shown.stdout
        callback = d.job(batch.on_success)
        assert callback.attempt == 1 and callback.finished_at > d.job(dead.id).finished_at
        assert os.path.exists(fixed)
        d.signal(signal.SIGTERM)
        assert d.wait_exit() == 0
        d.assert_clean()
    finally:
        d.stop()


def test_bad_workflow_input_is_one_line_and_exit_2(tmp_path):
    d = Daemon(tmp_path, handler_files=FLOWS)
    got = tangguh("enqueue", "flow_add", "--payload", "{}", "--depends-on", "job_unknown", "-c", d.config_path)
    assert got.returncode == 2
    assert got.stderr.strip().count("\n") == 0 and "unknown job job_unknown" in got.stderr
    got = tangguh("batch", "job_unknown", "-c", d.config_path)
    assert got.returncode == 1 and "no batch job_unknown" in got.stderr


def test_the_readme_workflow_renders_invoices_then_sends_one_summary(tmp_path):
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "handlers", "invoice_flow.py")) as f:
        handlers = f.read()
    with open(os.path.join(os.path.dirname(here), "README.md")) as f:
        assert handlers in f.read(), "the README's Workflows example is tests/handlers/invoice_flow.py verbatim"
    d = Daemon(tmp_path, handler_files=("invoice_flow.py",))
    try:
        d.start()
        with Client.from_url(d.broker_url) as client:
            flow = client.group([("render_invoice", {"invoice_id": i, "total": 1200 + i}) for i in range(50)],
                                then=("send_summary", {"month": "2026-11"}))
        summary = d.wait_job(flow.then)
        assert summary.result == {"invoices": 50, "total": sum(1200 + i for i in range(50))}
        assert [d.job(i).state for i in flow.ids] == ["done"] * 50
        d.signal(signal.SIGTERM)
        assert d.wait_exit() == 0
        d.assert_clean()
    finally:
        d.stop()


def test_run_jobs_runs_a_group_and_its_callback_in_process(tmp_path):
    from supervisor.testing import run_jobs

    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "handlers", "invoice_flow.py")
    spec = importlib.util.spec_from_file_location("invoice_flow_in_process", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with Client.from_url(f"sqlite:///{tmp_path}/broker.db") as client:
        flow = client.group([("render_invoice", {"invoice_id": i, "total": 100}) for i in range(3)],
                            then=("send_summary", {}))
        ran = run_jobs(client, handlers=[module])
    assert [r.type for r in ran] == ["render_invoice"] * 3 + ["send_summary"]
    assert ran[-1].job_id == flow.then and ran[-1].result == {"invoices": 3, "total": 300}
