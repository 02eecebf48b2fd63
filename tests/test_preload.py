"""What the master loads before it forks: the drivers its children will use, no other.

A module the master imports is shared by every child (its pages are the master's
until written); one a child imports itself is that child's own copy. So the
handlers' database driver is imported by the master (``toolkit.preload``), and a
daemon whose handlers have no database loads no driver for them; so is the
``idna`` codec that a first connection to a host name loads. Seen from outside,
in the master's memory map: a driver is a shared object it maps, and so is the
codec's ``unicodedata``.
"""
import signal

import pytest

from .daemon import Daemon
from .util import wait_for

# A piece of each driver's own shared object's path, as /proc/PID/maps shows it.
MAPPED = {"sqlite": "_sqlite3", "postgres": "psycopg"}


def mapped(pid):
    with open(f"/proc/{pid}/maps") as f:
        text = f.read()
    return {kind for kind, piece in MAPPED.items() if piece in text}


@pytest.fixture
def started(tmp_path, redis_url):
    """``started(**sections)``: a daemon on a Redis broker, up with its children; stopped after the test.
    A Redis broker: a driver mapped is there for the handlers' database, or not at all."""
    daemons = []

    def start(**sections):
        daemons.append(Daemon(tmp_path, redis_url, **sections))
        return daemons[-1].start()

    yield start
    for d in daemons:
        d.stop()


def assert_maps(d, kinds, workers):
    """The master and ``workers`` (their pids) map exactly the drivers of ``kinds``."""
    assert mapped(d.proc.pid) == kinds
    assert workers
    for pid in workers:
        assert mapped(pid) == kinds


def handlers_database(kind, tmp_path, request):
    if kind == "sqlite":
        return f"sqlite:///{tmp_path}/app.db"
    return request.getfixturevalue("postgres_url")


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_the_master_loads_the_handlers_database_driver_before_its_first_fork(started, tmp_path, kind, request):
    d = started(toolkit={"database_url": handlers_database(kind, tmp_path, request)})
    # Its children up, no job run yet: nothing has used the database.
    assert_maps(d, {kind}, d.worker_pids())  # the children's: the master's, inherited at the fork


def test_a_master_whose_handlers_have_no_database_loads_no_driver_for_them(started):
    d = started()
    assert d.wait_job(d.enqueue("noop", {"x": 1})).state == "done"
    assert_maps(d, set(), d.worker_pids())


def test_a_reload_that_names_a_handlers_database_loads_its_driver_for_the_new_children(started, tmp_path):
    d = started()
    assert_maps(d, set(), d.worker_pids())
    before = d.status()["generation"]
    d.config["toolkit"] = {"database_url": f"sqlite:///{tmp_path}/app.db"}
    d.write_config()
    d.signal(signal.SIGHUP)

    def new_children():
        status = d.status()
        assert status["reload_error"] is None
        workers = [w for w in status["workers"] if w["generation"] == before + 1 and w["state"] == "idle"]
        return len(workers) == status["target_workers"] and [w["pid"] for w in workers]

    assert_maps(d, {"sqlite"}, wait_for(new_children, message="the new generation's children up"))


def test_the_master_loads_the_socket_codec_before_its_first_fork(tmp_path):
    """Python's ``socket.getaddrinfo`` loads the ``idna`` codec at a process's first connection to
    a host name: a handler's Redis or HTTP client in each child, unless the master has it. On a
    SQLite broker the master connects to nothing that would load it on its own."""
    d = Daemon(tmp_path, f"sqlite:///{tmp_path}/queue.db").start()
    try:
        workers = d.worker_pids()
        assert workers
        for pid in [d.proc.pid, *workers]:  # no job run yet: the children's are the master's, inherited
            with open(f"/proc/{pid}/maps") as f:
                assert "unicodedata" in f.read()
    finally:
        d.stop()
