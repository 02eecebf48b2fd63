"""The framework recipes of docs/integrations.md, run as written under examples/ with a real supervisor."""
import os
import sqlite3
import subprocess
import sys

import pytest

from supervisor import testing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")


def test_django_enqueue_on_commit_and_orm_handlers_in_children(tmp_path, monkeypatch):
    pytest.importorskip("django")
    project = os.path.join(EXAMPLES, "django_shop")
    config = testing.write_config(str(tmp_path), os.path.join(project, "handlers"))
    broker_url = f"sqlite:///{tmp_path}/broker.db"
    monkeypatch.setenv("SHOP_DB", str(tmp_path / "shop.db"))
    monkeypatch.setenv("TANGGUH_BROKER_URL", broker_url)
    placed = subprocess.run([sys.executable, os.path.join(project, "place_orders.py")], capture_output=True,
                            text=True, timeout=120)
    assert placed.returncode == 0, placed.stderr
    order_id = int(placed.stdout.split()[-1])
    from supervisor.client import Client

    with Client.from_url(broker_url) as client:
        testing.assert_enqueued("send_receipt", where={"order_id": order_id}, client=client)
        testing.assert_enqueued("send_receipt", count=1, client=client)  # the rolled-back order enqueued nothing
        (job,) = testing.jobs_in_state("queued", "send_receipt", client=client)
    sup = testing.Supervisor(config).start()
    try:
        done = sup.wait_job(job.id)
    finally:
        sup.stop()
    assert (done.state, done.result) == ("done", {"order_id": order_id})
    db = sqlite3.connect(tmp_path / "shop.db")
    try:
        assert db.execute("SELECT email, receipt_sent FROM shop_order ORDER BY id").fetchall() == [
            ("ada@example.com", 1)]
    finally:
        db.close()


@pytest.fixture
def fastapi_example(tmp_path, monkeypatch):
    """(examples/fastapi_app's ``app`` module, its supervisor config, fastapi's TestClient)."""
    pytest.importorskip("fastapi")
    pytest.importorskip("httpx")
    from fastapi.testclient import TestClient

    config = testing.write_config(str(tmp_path), os.path.join(EXAMPLES, "fastapi_app", "handlers"))
    monkeypatch.setenv("TANGGUH_CONFIG", config)
    monkeypatch.syspath_prepend(os.path.join(EXAMPLES, "fastapi_app"))
    import app as fastapi_app

    return fastapi_app, config, TestClient


def test_fastapi_enqueue_from_an_endpoint_and_wait_for_the_result(fastapi_example):
    fastapi_app, config, TestClient = fastapi_example
    sup = testing.Supervisor(config).start()
    try:
        with TestClient(fastapi_app.app) as http:
            bad = http.post("/orders/x/receipt", params={"email": "a@b"})
            accepted = http.post("/orders/7/receipt", params={"email": "ada@example.com"})
            assert accepted.status_code == 202, accepted.text
            again = http.post("/orders/7/receipt", params={"email": "ada@example.com"})
            result = http.get(f"/jobs/{accepted.json()['job_id']}", params={"timeout": 20})
            missing = http.get("/jobs/job_nope", params={"timeout": 1})
    finally:
        sup.stop()
    assert bad.status_code == 422 and missing.status_code == 404
    assert again.json() == accepted.json()  # the idempotency key: one job per order
    assert result.status_code == 200 and result.json() == {
        "state": "done", "result": {"sent_to": "ada@example.com", "order_id": 7}, "reason": None}


def test_fastapi_result_endpoint_answers_at_once_for_a_cancelled_job(fastapi_example):
    from supervisor.client import Client

    fastapi_app, config, TestClient = fastapi_example
    with TestClient(fastapi_app.app) as http, Client.from_config(config) as client:
        job_id = http.post("/orders/8/receipt", params={"email": "bob@example.com"}).json()["job_id"]
        client.cancel(job_id)  # no supervisor runs: it is cancelled while queued
        result = http.get(f"/jobs/{job_id}", params={"timeout": 5})
    assert result.status_code == 200, result.text
    assert result.json()["state"] == "cancelled"
