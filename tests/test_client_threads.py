"""One ``Client`` shared by many threads: a module-level client in a threaded web app, or the
default client set with ``supervisor.configure(client=...)``, which every thread gets."""
import os
import threading

import pytest

import supervisor
from supervisor import jobref
from supervisor.backends import open_broker
from supervisor import client as client_module
from supervisor import waitbrokers
from supervisor.client import Client
from supervisor.errors import BadInput, ConfigError
from supervisor.jobfilter import JobFilter
from supervisor.model import NewJob

from .util import wait_for

THREADS = 16
ROUNDS = 10  # per thread: alternately a plain enqueue and a two-step chain


@pytest.fixture
def shared(broker_url):
    with open_broker(broker_url) as broker:
        broker.migrate()
    client = Client.from_url(broker_url)
    saved = jobref.save()
    supervisor.configure(client=client)
    yield client
    jobref.restore(saved)
    client.close()


def _run_threads(work):
    start = threading.Barrier(THREADS)  # all threads reach the client together
    errors = []

    def run(t):
        start.wait()
        try:
            work(t)
        except Exception as exc:  # noqa: BLE001 - every failure is reported by the assertion below
            errors.append(repr(exc))

    threads = [threading.Thread(target=run, args=(t,)) for t in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not any(thread.is_alive() for thread in threads)
    return errors


def test_threads_sharing_one_client_store_every_job_they_were_told_of_exactly_once(shared, broker_url):
    plain = supervisor.JobRef("plain")
    expected = {}  # id -> (type, payload, state, parent ids) as a fresh connection must read them
    defaults = []
    lock = threading.Lock()

    def work(t):
        client = jobref.default_client()
        with lock:
            defaults.append(client)
        for i in range(ROUNDS):
            if i % 2:
                first, second = client.chain([("step", {"t": t, "i": i, "n": 0}), ("step", {"t": t, "i": i, "n": 1})])
                stored = {first: ("step", {"t": t, "i": i, "n": 0}, "queued", []),
                          second: ("step", {"t": t, "i": i, "n": 1}, "waiting", [first])}
            else:
                stored = {plain.enqueue({"t": t, "i": i}): ("plain", {"t": t, "i": i}, "queued", [])}
            with lock:
                assert not set(stored) & set(expected), "an id was returned twice"
                expected.update(stored)

    assert _run_threads(work) == []
    assert all(client is shared for client in defaults)
    assert len(expected) == THREADS * (ROUNDS // 2) * 3
    # Read while the shared client is still open: a transaction it left open would hide its jobs.
    with open_broker(broker_url) as fresh:
        assert fresh.count(JobFilter()).n == len(expected)
        for job_id, (type_, payload, state, parents) in expected.items():
            job = fresh.get(job_id)
            assert job is not None, f"{job_id} was returned but never stored"
            assert (job.type, job.payload, job.state, sorted(job.parents or {})) == (type_, payload, state, parents)
    # The shared client still works afterwards (no transaction left half open on it).
    job_id = shared.enqueue("after", {})
    with open_broker(broker_url) as fresh:
        assert fresh.get(job_id).state == "queued"


def test_a_wait_does_not_hold_up_the_other_threads_calls(shared):
    job_id = shared.enqueue("plain", {})
    assert shared.cancel(job_id) == {job_id: "cancelled"}
    outcome = []
    with shared._lock:  # another thread is inside a broker call for as long as this block lasts
        waiter = threading.Thread(target=lambda: outcome.append(shared.wait(job_id, 30)))
        waiter.start()
        waiter.join(20)
        assert not waiter.is_alive(), "wait queued behind another thread's call"
    assert [job.state for job in outcome] == ["cancelled"]


def test_a_call_from_a_thread_already_in_a_call_of_the_same_client_is_refused(broker, broker_url):
    """A signal handler that enqueues while its thread is inside a call of the same client
    ran inside that call: on PostgreSQL it hung in the driver, on SQLite it failed inside
    the open transaction, on Redis it met a half-imported module. It is refused at once."""
    client = Client.from_url(broker_url)
    with client._guard():  # what a signal handler interrupting a call finds
        with pytest.raises(RuntimeError, match="in a call on this same thread already"):
            client.enqueue("t", {})
    assert client.get(client.enqueue("t", {})).state == "queued"
    client.close()


def test_waits_one_after_another_reuse_their_broker_and_many_at_once_keep_a_few(broker_url, monkeypatch):
    """A web app waiting in every request must not open a broker (on PostgreSQL two server
    connections) per request: a client keeps its wait brokers, up to waitbrokers.KEPT."""
    opened, closed = [], []

    def counted(url):
        broker = open_broker(url)
        broker.close = lambda close=broker.close: (closed.append(broker), close())[1]
        opened.append(broker)
        return broker

    monkeypatch.setattr(client_module, "open_broker", counted)
    monkeypatch.setattr(waitbrokers, "open_broker", counted)
    with open_broker(broker_url) as broker:
        broker.migrate()
    client = Client.from_url(broker_url)
    job_id = client.enqueue("t", {})
    for _ in range(5):
        assert client.wait(job_id, 0.01) is None
    assert len(opened) == 2  # the client's own, and one for every wait
    with pytest.raises(BadInput, match="unknown job"):
        client.wait("job_nope", 0.01)  # an answer, not a broken broker: it is kept
    assert len(opened) == 2

    # Many threads at once each need a broker; afterwards only WAIT_BROKERS_KEPT stay open.
    _run_threads(lambda t: client.wait(job_id, 1.0))
    assert len(client._waits.idle) == waitbrokers.KEPT
    assert len(closed) == len(opened) - 1 - waitbrokers.KEPT
    client.close()
    assert client._waits.idle == [] and sorted(map(id, closed)) == sorted(map(id, opened))

    # A close() while a wait runs: that wait's broker is closed when it ends, not kept.
    before = len(opened)
    waiting = threading.Thread(target=client.wait, args=(job_id, 2.0))
    waiting.start()
    wait_for(lambda: len(opened) == before + 2, message="the wait's brokers (the client's own, reopened, and its own)")
    client.close()
    waiting.join(30)
    assert client._waits.idle == [] and sorted(map(id, closed)) == sorted(map(id, opened))


def test_a_relative_sqlite_url_names_one_file_for_the_clients_whole_life(tmp_path, monkeypatch):
    """The wait broker opened later, after the process changed directory, looked for
    ``jobs.db`` in the new one: "unknown job", and an empty database left there."""
    (tmp_path / "app").mkdir()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "app")
    with open_broker("sqlite:///jobs.db") as broker:
        broker.migrate()
    client = Client.from_url("sqlite:///jobs.db")
    try:
        job_id = client.enqueue("t", {})
        monkeypatch.chdir(tmp_path / "elsewhere")
        assert client.wait(job_id, 0.01) is None  # not finished, and found
        client.close()  # reopened on the next call, in the directory of its first
        assert client.get(job_id).state == "queued"
    finally:
        client.close()
    assert list((tmp_path / "elsewhere").iterdir()) == []


@pytest.mark.parametrize("bad", [12345, "", "job\x00x", "job_\ud800", "j" * 256])
def test_an_id_no_job_can_have_is_one_bad_input_line_on_every_broker(broker_url, bad):
    """PostgreSQL answered wait(12345) with "schema missing or outdated (run tangguh db migrate)",
    a NUL id with a query failure; a lone surrogate was a raw UnicodeEncodeError."""
    with open_broker(broker_url) as broker:
        broker.migrate()
    with Client.from_url(broker_url) as client:
        for call in (lambda: client.get(bad), lambda: client.wait(bad, 0.01)):
            with pytest.raises(BadInput, match="job id must be a string of 1 to 255 characters"):
                call()


@pytest.mark.parametrize("bad", [5, None, 1.5])
def test_ids_or_steps_that_are_no_list_are_one_bad_input_line(broker_url, bad):
    """cancel(5), requeue(None), discard(None) and chain(None) raised raw TypeErrors ("'int'
    object is not iterable") where every other bad input is one BadInput line."""
    with Client.from_url(broker_url) as client:
        for call in (lambda: client.cancel(bad), lambda: client.requeue(bad), lambda: client.discard(bad)):
            with pytest.raises(BadInput, match="job ids must be a list"):
                call()
        with pytest.raises(BadInput, match="a chain's steps must be a list of jobs"):
            client.chain(bad)


@pytest.mark.parametrize("bad", [5, 1.5, object()])
def test_queues_that_are_no_list_are_one_bad_input_line(sqlite_url, bad):
    """Client(queues=5), stats(5) and run_jobs(queues=5) raised "'int' object is not iterable"."""
    from supervisor.testing import run_jobs

    with Client.from_url(sqlite_url) as client:
        for call in (lambda: Client.from_url(sqlite_url, queues=bad), lambda: client.stats(bad),
                     lambda: run_jobs(client, queues=bad)):
            with pytest.raises(BadInput, match="queues must be a list"):
                call()
        assert list(client.stats("default")) == ["default"]  # one name is that queue, not its letters


def test_a_wait_with_a_bad_timeout_is_refused_for_a_finished_job_too(broker_url):
    with open_broker(broker_url) as broker:
        broker.migrate()
        job_id = broker.enqueue(NewJob("t", {}))
        broker.cancel([job_id], "ops", None)
    with Client.from_url(broker_url) as client:
        assert client.wait(job_id, 0).state == "cancelled"
        for timeout in (-5, float("nan"), float("inf"), "1"):
            with pytest.raises(BadInput, match="timeout must be a number of seconds >= 0"):
                client.wait(job_id, timeout)


def test_a_queue_named_by_a_string_is_that_queue_not_its_letters(broker_url):
    """stats("emails") answered for the queues "e", "m", "a"... (each empty: a silently wrong
    count), and Client.from_url(url, queues="emails") served those letters: every enqueue to
    "emails" was refused as not one of the client's queues."""
    with open_broker(broker_url) as broker:
        broker.migrate()
    with Client.from_url(broker_url, queues="emails") as client:
        assert client.queues == ["emails"]
        client.enqueue("t", {}, queue="emails")
        stats = client.stats("emails")
        assert list(stats) == ["emails"] and stats["emails"].ready == 1


def test_a_client_from_no_config_file_is_refused_not_pointed_at_a_new_sqlite_file(tmp_path, monkeypatch):
    """With neither ./tangguh.toml nor /etc/tangguh/config.toml there, Client.from_config() took
    the built-in defaults: a producer (a web app started in another directory, a container
    without the file) enqueued into a new ./tangguh.db that no supervisor reads, without a word."""
    if os.path.exists("/etc/tangguh/config.toml"):
        pytest.skip("this machine has /etc/tangguh/config.toml")
    monkeypatch.chdir(tmp_path)
    for call in (lambda: Client.from_config(), lambda: Client.from_config("")):
        with pytest.raises(ConfigError, match=r"no config file: neither ./tangguh.toml nor /etc/tangguh/config.toml"):
            call()
    monkeypatch.setenv("TANGGUH_CONFIG", "")
    saved = jobref.save()
    supervisor.configure(config="")
    try:
        with pytest.raises(ConfigError, match="no config file"):
            supervisor.JobRef("t").enqueue({})
    finally:
        jobref.restore(saved)
    assert list(tmp_path.iterdir()) == []
