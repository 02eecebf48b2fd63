"""Job control from the producer API and the command line: cancel, wait, pause, expiry, supervisors.

Commands run in-process through ``cli.main`` against a real SQLite broker;
``job --wait`` also runs as its own process, woken by another process's ack.
"""
import json
import textwrap
import threading

import pytest

from supervisor import cli
from supervisor.backends import open_broker
from supervisor.client import Client
from supervisor.errors import BadInput
from supervisor.jobref import JobRef
from supervisor.model import NewJob

from .daemon import tangguh as tangguh_process
from .util import wait_for


@pytest.fixture
def cfg_path(tmp_path):
    path = tmp_path / "tangguh.toml"
    path.write_text(textwrap.dedent("""
        [broker]
        url = "sqlite:///broker.db"
        queues = ["default", "bulk"]
    """))
    return str(path)


@pytest.fixture
def broker(tmp_path, cfg_path):
    b = open_broker(f"sqlite:///{tmp_path}/broker.db")
    yield b
    b.close()


def tangguh(capsys, *args):
    code = cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def claim_one(broker, queue="default"):
    [job] = broker.claim([queue], 1, 60, "w1")
    return job


# -- the producer API ---------------------------------------------------------------

def test_client_enqueue_with_expiry_cancel_wait_and_pause(broker, cfg_path):
    with Client.from_config(cfg_path) as client:
        expiring = client.enqueue("email", {"to": "a"}, expires_in=30)
        job = broker.get(expiring)
        assert job.expires_at == pytest.approx(job.queued_at + 30, abs=0.5)
        via_handler = JobRef("email").enqueue({"to": "b"}, client=client, expires_in=60)
        assert broker.get(via_handler).expires_at is not None
        [second] = client.enqueue_many([("email", {"to": "c"}, {"expires_in": 5})])
        assert broker.get(second).expires_at is not None
        with pytest.raises(BadInput, match="expires_in"):
            client.enqueue("email", {}, expires_in=-1)

        assert client.cancel(expiring, by="ops", reason="typo") == {expiring: "cancelled"}
        assert client.wait(expiring, 5).state == "cancelled"
        client.pause("bulk", by="ops")
        assert list(client.paused()) == ["bulk"]
        client.resume("bulk")
        assert client.paused() == {}


# -- tangguh enqueue --expires-in, tangguh job -------------------------------------------

def test_enqueue_expires_in_and_job_shows_progress_and_cancel_request(capsys, cfg_path, broker):
    code, out, err = tangguh(capsys, "enqueue", "email", "--expires-in", "120", "-c", cfg_path)
    assert code == 0, err
    job_id = out.strip()
    assert broker.get(job_id).expires_at is not None
    job = claim_one(broker)
    broker.renew([job.lease], 60, progress={job_id: (0.4, "40 of 100 rows")})
    broker.cancel([job_id], "alice@host", "wrong list")
    code, out, err = tangguh(capsys, "job", job_id, "-c", cfg_path)
    assert code == 0, err
    assert "40% 40 of 100 rows" in out
    assert "cancel_request:" in out and "alice@host" in out and "wrong list" in out
    code, out, _ = tangguh(capsys, "job", job_id, "--json", "-c", cfg_path)
    shown = json.loads(out)
    assert shown["progress"] == 0.4 and shown["cancel_request"]["by"] == "alice@host"


@pytest.mark.parametrize("value", ["-1", "0", "nan"])
def test_enqueue_refuses_a_bad_expires_in_and_stores_nothing(capsys, cfg_path, broker, value):
    code, out, err = tangguh(capsys, "enqueue", "email", "--expires-in", value, "-c", cfg_path)
    assert code == 2 and out == "" and "expires_in" in err and len(err.strip().splitlines()) == 1
    assert broker.stats(["default"])["default"].ready == 0


# -- tangguh job ID --wait --------------------------------------------------------------

@pytest.mark.parametrize("ending, code", [("ack", 0), ("dead", 1), ("cancel", 1)])
def test_job_wait_exits_by_how_the_job_ended(capsys, cfg_path, broker, ending, code):
    job_id = broker.enqueue(NewJob("email", {}))
    if ending == "cancel":
        broker.cancel([job_id], "ops", None)
    else:
        job = claim_one(broker)
        if ending == "ack":
            broker.ack(job.lease, {"sent": True})
        else:
            broker.dead(job.lease, "permanent", {"reason": "permanent", "class": "E", "message": "", "traceback": ""})
    got, out, err = tangguh(capsys, "job", job_id, "--wait", "--timeout", "5", "-c", cfg_path)
    assert got == code, err
    assert f"{job_id}" in out


def test_job_wait_exits_124_on_timeout_and_1_for_an_unknown_job(capsys, cfg_path, broker):
    job_id = broker.enqueue(NewJob("email", {}))
    code, out, err = tangguh(capsys, "job", job_id, "--wait", "--timeout", "0.2", "-c", cfg_path)
    assert code == 124 and "not finished after 0.2s" in err
    assert "state:" in out and "queued" in out
    code, out, err = tangguh(capsys, "job", "job_nope", "--wait", "--timeout", "1", "-c", cfg_path)
    assert code == 1 and "not found" in err
    code, out, err = tangguh(capsys, "job", job_id, "--wait", "--timeout", "-3", "-c", cfg_path)
    assert code == 2 and "--timeout" in err


def test_job_timeout_without_wait_is_a_usage_error(capsys, cfg_path, broker):
    """`job ID --timeout 60` (the --wait forgotten) printed the job at once and exited 0, as if it
    had finished within the minute; a negative --timeout passed the same way."""
    job_id = broker.enqueue(NewJob("email", {}))
    for timeout in ("60", "-3"):
        code, out, err = tangguh(capsys, "job", job_id, "--timeout", timeout, "-c", cfg_path)
        assert (code, out) == (2, "") and err.strip() == "tangguh: error: job: --timeout only goes with --wait"


def test_job_wait_for_a_job_deleted_while_it_waits_exits_1(capsys, cfg_path, broker, monkeypatch):
    """The broker's "unknown job" came out as a usage error, exit 2 (nothing wrong with the
    command line), where `tangguh job ID` of the same id exits 1, "not found"."""
    from supervisor.client import Client

    job_id = broker.enqueue(NewJob("email", {}))
    real_wait = Client.wait

    def discarded_first(client, *args):  # an operator's discard lands between the look and the wait
        broker.discard([job_id])
        return real_wait(client, *args)
    monkeypatch.setattr(Client, "wait", discarded_first)
    code, out, err = tangguh(capsys, "job", job_id, "--wait", "--timeout", "5", "-c", cfg_path)
    assert code == 1 and err.strip() == f"tangguh: error: job {job_id} not found (deleted while waiting)", err


def test_job_wait_with_an_infinite_timeout_waits_as_long_as_it_takes(capsys, cfg_path, broker):
    job_id = broker.enqueue(NewJob("email", {}))
    broker.cancel([job_id], "ops", None)
    code, out, err = tangguh(capsys, "job", job_id, "--wait", "--timeout", "inf", "-c", cfg_path)
    assert code == 1 and "cancelled" in out, err


def test_job_wait_as_a_process_is_woken_by_another_process_ack(tmp_path, cfg_path, broker):
    job_id = broker.enqueue(NewJob("email", {}))
    job = claim_one(broker)
    done = {}

    def run():
        done["proc"] = tangguh_process("job", job_id, "--wait", "--timeout", "60", "--json", "-c", cfg_path,
                                       timeout=90, cwd=str(tmp_path))

    t = threading.Thread(target=run)
    t.start()
    broker.ack(job.lease, {"ok": 1})
    t.join(90)
    proc = done["proc"]
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["result"] == {"ok": 1}


# -- tangguh queue list|pause|resume ---------------------------------------------------

def test_queue_pause_resume_and_list(capsys, cfg_path, broker):
    parent = broker.enqueue(NewJob("email", {}, queue="bulk"))
    broker.enqueue(NewJob("email", {}, queue="bulk", depends_on=[parent]))
    code, out, err = tangguh(capsys, "queue", "pause", "bulk", "-c", cfg_path)
    assert code == 0, err
    assert "paused bulk" in out
    assert "bulk" in broker.paused() and "@" in broker.paused()["bulk"]["by"]
    assert broker.claim(["bulk"], 5, 30, "w") == []
    code, out, err = tangguh(capsys, "queue", "list", "-c", cfg_path)
    assert code == 0, err
    header, *rows = out.splitlines()
    line = next(line for line in rows if line.startswith("bulk"))
    assert dict(zip(header.split(), line.split())) == {
        "QUEUE": "bulk", "STATE": "paused", "PAUSED_BY": broker.paused()["bulk"]["by"], "READY": "1",
        "SCHEDULED": "0", "WAITING": "1", "IN_FLIGHT": "0", "DEAD": "0", "CANCELLED": "0", "EXPIRED": "0"}
    code, out, _ = tangguh(capsys, "queue", "list", "--json", "-c", cfg_path)
    rows = {row["queue"]: row for row in json.loads(out)}
    assert rows["bulk"]["paused"] is True and rows["bulk"]["ready"] == 1
    code, out, err = tangguh(capsys, "queue", "resume", "bulk", "-c", cfg_path)
    assert code == 0, err
    assert broker.paused() == {}


def test_a_configured_queue_can_be_paused_before_it_holds_a_job(capsys, cfg_path, broker):
    """A queue of the config's broker.queues was "unknown" until a job or a running supervisor
    named it: `queue pause bulk` before starting the supervisors of a deploy was exit 2."""
    code, out, err = tangguh(capsys, "queue", "pause", "bulk", "-c", cfg_path)
    assert code == 0 and err == "" and "paused bulk" in out
    assert list(broker.paused()) == ["bulk"]
    broker.enqueue(NewJob("email", {}, queue="bulk"))
    assert broker.claim(["bulk"], 5, 30, "w") == []
    code, out, err = tangguh(capsys, "queue", "resume", "bulk", "-c", cfg_path)
    assert code == 0 and broker.paused() == {}
    code, out, err = tangguh(capsys, "queue", "pause", "nosuch", "-c", cfg_path)
    assert code == 2
    assert err.strip() == "tangguh: error: unknown queue 'nosuch' (the broker and the config know bulk, default)"


@pytest.mark.parametrize("name", ["nosuch", "bad name!"])
def test_pausing_an_unknown_or_malformed_queue_is_exit_2_and_changes_nothing(capsys, cfg_path, broker, name):
    broker.enqueue(NewJob("email", {}))
    for verb in ("pause", "resume"):
        code, out, err = tangguh(capsys, "queue", verb, name, "-c", cfg_path)
        assert code == 2 and out == ""
        assert len(err.strip().splitlines()) == 1 and repr(name) in err
    assert broker.paused() == {}


# -- tangguh supervisors ------------------------------------------------------------------

def test_supervisors_lists_live_and_gone_records(capsys, cfg_path, broker):
    code, out, _ = tangguh(capsys, "supervisors", "-c", cfg_path)
    assert code == 0 and "no supervisors" in out
    broker.write_supervisor({"id": "host-a:1", "host": "host-a", "pid": 1, "queues": ["default"], "paused": [],
                             "version": "1.0", "workers": [{"slot": 0, "pid": 2, "job_id": "job_x"},
                                                           {"slot": 1, "pid": 3, "job_id": None}]}, ttl=60)
    broker.write_supervisor({"id": "host-b:9", "host": "host-b", "pid": 9, "queues": ["bulk"]}, ttl=0.2)
    wait_for(lambda: {r["id"]: r["gone"] for r in broker.supervisors()}.get("host-b:9"), message="host-b gone")
    code, out, err = tangguh(capsys, "supervisors", "-c", cfg_path)
    assert code == 0, err
    a = next(line for line in out.splitlines() if line.startswith("host-a:1"))
    b = next(line for line in out.splitlines() if line.startswith("host-b:9"))
    assert "live" in a and "1/2" in a and "gone" in b
    code, out, _ = tangguh(capsys, "supervisors", "--json", "-c", cfg_path)
    records = {r["id"]: r for r in json.loads(out)}
    assert records["host-a:1"]["gone"] is False and records["host-b:9"]["gone"] is True
