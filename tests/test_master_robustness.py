"""The master survives idle time and hostile input: idle polling, the health
socket, oversize results, unbounded label sets, a socket path that is a file.

Process tests run the real ``tangguh run`` (tests/daemon.py) and end with the
daemon still serving: a job runs after the hostile part.
"""
import contextlib
import json
import os
import selectors
import signal
import socket
import select
import stat
import subprocess
import sys
import threading

import pytest
from prometheus_client.parser import text_string_to_metric_families

from supervisor.health import HealthServer, request
from supervisor.model import MAX_ERROR_MESSAGE, MAX_ERROR_TRACEBACK, NewJob, error_info
from supervisor.oneshot import OneShotServer
from supervisor.retry import backoff, next_delay

from .daemon import Daemon, read_lines, tangguh
from .util import wait_for


@pytest.fixture
def daemon(tmp_path):
    d = Daemon(tmp_path)
    yield d
    d.stop()


def serves_a_job(d):
    job_id = d.enqueue("noop", {})
    assert d.wait_job(job_id).state == "done"


# -- backoff ---------------------------------------------------------------------------

@pytest.mark.parametrize("tries", [1_000, 1_025, 10_000, 10**6, 10**18])
def test_backoff_after_a_very_long_streak_is_the_cap(tries):
    assert backoff(tries, 0.005, 0.5) == 0.5
    assert backoff(tries, 0.2, 10.0, jitter=0.5, rng=lambda: 1.0) == 5.0
    assert next_delay(tries, 1.0, 300.0, 0.0) == 300.0


def test_backoff_doubles_from_base():
    assert [backoff(n, 0.1, 100.0) for n in (0, 1, 2, 3, 4)] == [0.1, 0.1, 0.2, 0.4, 0.8]


def test_idle_supervisor_survives_thousands_of_empty_polls_then_serves(tmp_path):
    # The old backoff overflowed a float after ~1,024 empty claims in a row.
    d = Daemon(tmp_path, supervisor={"poll_interval": 0.001})
    try:
        d.start()
        wait_for(lambda: d.status()["empty_polls"] >= 3000, timeout=120, message="3,000 empty polls")
        assert d.proc.poll() is None
        serves_a_job(d)
        d.signal(signal.SIGTERM)
        assert d.wait_exit() == 0
        d.assert_clean()
    finally:
        d.stop()


# -- the health socket ---------------------------------------------------------------------

def connect(path):
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)  # blocking: waits while the listen backlog is full
    s.settimeout(10)
    return s


def reply_or_eof(s):
    """The reply line, or b"" when the daemon closed the connection without one."""
    data = bytearray()
    while not data.endswith(b"\n"):
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    return bytes(data)


def test_deeply_nested_json_on_the_health_socket_gets_an_error(daemon):
    daemon.start()
    for line, error in ((b"[" * 60_000 + b"\n", b"nests too deep"), (b"{\"a\": " * 10_000 + b"\n", b"nests too deep"),
                        (b'{"cmd": ' + b"[" * 900 + b"]" * 900 + b"}\n", b'"cmd\\" string')):
        s = connect(daemon.socket)
        s.sendall(line)
        reply = reply_or_eof(s)
        s.close()
        assert reply.startswith(b'{"ok": false') and error in reply, reply[:200]
    assert daemon.proc.poll() is None
    result = tangguh("status", "-c", daemon.config_path)
    assert result.returncode == 0, result.stderr
    serves_a_job(daemon)
    daemon.assert_clean()


def test_a_request_line_without_its_newline_is_answered_once_the_client_half_closes(daemon):
    """``printf '{"cmd": "status"}' | socat - UNIX-CONNECT:...``: no newline, then EOF. It got no
    reply at all; the line is the whole request once nothing more can come."""
    daemon.start()
    s = connect(daemon.socket)
    s.sendall(b'{"cmd": "status"}')
    s.shutdown(socket.SHUT_WR)
    reply = reply_or_eof(s)
    s.close()
    assert json.loads(reply)["ok"] is True, reply[:200]
    assert daemon.proc.poll() is None
    serves_a_job(daemon)


def closed_by_peer(s):
    """Whether the daemon has closed ``s`` (a reply it sent first is read and ignored)."""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return True
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def test_idle_connections_cannot_lock_out_status_and_are_closed(daemon):
    daemon.start()
    idle = [connect(daemon.socket) for _ in range(OneShotServer.max_clients)]
    try:
        for s in idle:
            s.setblocking(False)
        # Every slot is held by a silent connection: the next client still gets its answer.
        for _ in range(3):
            result = tangguh("status", "-c", daemon.config_path)
            assert result.returncode == 0, result.stderr
        assert daemon.status()["ok"] is True
        # Who made room (if anyone: a request already there when accepted is answered at once)
        # is in test_at_the_limit_the_oldest_silent_connection_makes_room.
        # The rest are closed after the idle bound, without anyone else connecting.
        wait_for(lambda: all(closed_by_peer(s) for s in idle), timeout=20, message="idle connections closed")
    finally:
        for s in idle:
            s.close()
    serves_a_job(daemon)
    daemon.assert_clean()


FLOOD = r"""
import collections, socket, sys, threading

address = sys.argv[1]
family = socket.AF_UNIX if address.startswith("/") else socket.AF_INET
if family == socket.AF_INET:
    host, port = address.rsplit(":", 1)
    address = (host, int(port))
limit, threads, hold = int(sys.argv[2]), 8, 100
opened, stop, under_way = [0] * threads, threading.Event(), threading.Lock()

def run(i):
    held = collections.deque()
    while not stop.is_set():
        s = socket.socket(family)
        try:
            s.settimeout(10)
            s.connect(address)
        except OSError:
            s.close()
            continue
        held.append(s)
        opened[i] += 1
        if len(held) > hold:
            held.popleft().close()
        if sum(opened) > limit and under_way.acquire(blocking=False):
            print("flooding", flush=True)
    for s in held:
        s.close()

threads = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
for t in threads:
    t.start()
sys.stdin.read()  # until the test closes our stdin
stop.set()
for t in threads:
    t.join()
print(*opened, flush=True)
"""


class SilentFlood:
    """Another process whose 8 threads open connections as fast as the server takes them (its
    accept queue full), never send a byte, and each keep 100 of them open (the oldest closed
    as new ones open).

    Not threads of the test: the GIL would starve the test's own client between its
    connect and its request, which no real client (a Prometheus scrape, the CLI) does.
    """

    def __init__(self, address):
        self.address = address
        self.opened = None

    def __enter__(self):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", FLOOD, self.address, str(2 * OneShotServer.max_clients)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        # Past the server's limit before the first real client comes.
        wait_for(lambda: select.select([self.proc.stdout], [], [], 0.1)[0], timeout=60,
                 message="the flood under way")
        assert self.proc.stdout.readline() == "flooding\n"
        return self

    def __exit__(self, *exc):
        out, _ = self.proc.communicate(timeout=60)
        self.opened = [int(n) for n in out.split()]


def test_a_flood_of_silent_connections_cannot_lock_out_status_or_metrics(tmp_path):
    # The accept loop took connections without end and shed the oldest unread one: the
    # operator's own, while a flood kept the accept queue full (and the CLI's connect
    # failed at once with EAGAIN on a full queue).
    d = Daemon(tmp_path, metrics={"listen": "127.0.0.1:0"})
    try:
        d.start()
        host, port = d.status()["metrics_listen"].rsplit(":", 1)
        with SilentFlood(d.socket) as flood:
            for _ in range(20):
                assert request(d.socket, {"cmd": "status"}, timeout=10)["ok"] is True
            result = tangguh("status", "-c", d.config_path)
            assert result.returncode == 0, result.stderr
        assert all(flood.opened), flood.opened
        with SilentFlood(f"{host}:{port}") as flood:
            for _ in range(20):
                # Prometheus scrapes from a host of its own; the flood comes from 127.0.0.1.
                with socket.create_connection((host, int(port)), timeout=10, source_address=("127.0.0.2", 0)) as s:
                    s.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
                    assert reply_or_eof(s).startswith(b"HTTP/1.0 200"), "a scrape went unanswered"
        assert all(flood.opened), flood.opened
        serves_a_job(d)
        d.signal(signal.SIGTERM)
        assert d.wait_exit() == 0
        d.assert_clean()
    finally:
        d.stop()


def test_a_request_waits_for_room_in_a_full_accept_queue(tmp_path):
    # The flood above makes the CLI meet a full queue only as often as the flood outruns the
    # master; here the queue is full for certain. A connect under a socket timeout is
    # non-blocking and failed at once (EAGAIN); a blocking one waits in the kernel for room.
    path = str(tmp_path / "s.sock")
    with contextlib.ExitStack() as stack:
        listener = stack.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
        listener.bind(path)
        listener.listen(0)
        fillers = 0
        while True:  # connections nobody accepts, until the kernel takes no more
            filler = stack.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
            filler.setblocking(False)
            try:
                filler.connect(path)
            except BlockingIOError:
                break
            fillers += 1
        asked = {}

        def ask():
            asked["tid"] = threading.get_native_id()
            try:
                asked["reply"] = request(path, {"cmd": "ping"}, timeout=60)
            except Exception as exc:  # noqa: BLE001 - the assertion below shows it
                asked["error"] = exc

        thread = threading.Thread(target=ask, daemon=True)
        thread.start()

        def waiting_in_connect():
            try:
                with open(f"/proc/self/task/{asked['tid']}/wchan") as f:
                    if f.read() == "unix_wait_for_peer":
                        return True
            except (FileNotFoundError, ProcessLookupError):  # the thread has ended
                pass
            return "error" in asked or "reply" in asked

        wait_for(lambda: "tid" in asked and waiting_in_connect(), message="the request in its connect")
        assert "error" not in asked, asked["error"]
        listener.settimeout(60)
        for _ in range(fillers):  # first in the queue
            stack.enter_context(listener.accept()[0])
        conn = stack.enter_context(listener.accept()[0])  # the request's, let in as room was made
        conn.settimeout(60)
        assert conn.recv(100) == b'{"cmd": "ping"}\n'
        conn.sendall(b'{"ok": true}\n')
        thread.join(60)
    assert asked == {"tid": asked["tid"], "reply": {"ok": True}}


def pump(sel, until, message):
    """Run the server's side of the loop (no expiry: no time-based closing) until ``until()``."""
    def turn():
        for key, mask in sel.select(0.05):
            key.data(mask)
        return until()
    wait_for(turn, message=message)


def pumped_reply(sel, s):
    """Send a ping on ``s`` and run the server until its reply line is read."""
    s.sendall(b'{"cmd": "ping"}\n')
    s.setblocking(False)
    got = bytearray()

    def answered():
        try:
            got.extend(s.recv(4096))
        except BlockingIOError:
            pass
        return got.endswith(b"\n")
    pump(sel, answered, "the reply")
    return bytes(got)


class FullHealthServer:
    """A health server driven by the test (``pump``), its table filled to ``max_clients`` with
    silent connections of this process (``held``), or of another process first (``hold_elsewhere``)."""

    def __init__(self, tmp_path):
        self.sel = selectors.DefaultSelector()
        self.path = str(tmp_path / "s.sock")
        self.server = HealthServer(self.path, 0o600, self.sel, lambda req: {"ok": True, "pong": True})
        self.held, self.holder = [], None

    def fill(self, count=None):
        for _ in range(self.server.max_clients if count is None else count):
            self.held.append(connect(self.path))  # one at a time: the listen backlog is shorter than the table
            self.held[-1].setblocking(False)
            pump(self.sel, lambda: len(self.server.clients) == len(self.held), "the connection accepted")
        return self.held

    def hold_elsewhere(self, count, write=b""):
        """Another process opens ``count`` connections, one after another (a connect waits while
        the backlog is full), writes ``write`` on each, and says so when the last one is made."""
        self.holder = subprocess.Popen(
            [sys.executable, "-c", "import socket, sys\nheld = [socket.socket(socket.AF_UNIX) for _ in range(int(sys.argv[2]))]\n"
             "for s in held:\n    s.connect(sys.argv[1])\n    s.sendall(sys.argv[3].encode())\n"
             "print('held', flush=True)\nsys.stdin.read()", self.path, str(count), write.decode()],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        pump(self.sel, lambda: select.select([self.holder.stdout], [], [], 0)[0], "the other process's connections made")
        pump(self.sel, lambda: not select.select([self.server.listener], [], [], 0)[0], "the last one accepted")

    def close(self):
        if self.holder is not None:
            self.holder.kill()
            self.holder.wait()
        for s in self.held:
            s.close()
        self.server.close()
        self.sel.close()


@pytest.fixture
def full(tmp_path):
    f = FullHealthServer(tmp_path)
    yield f
    f.close()


def test_at_the_limit_the_oldest_silent_connection_makes_room(full):
    sel, path, server = full.sel, full.path, full.server
    idle = full.fill()
    # A request there when its connection is accepted is answered at once: nobody is pushed out.
    asker = connect(path)
    assert b'"pong": true' in pumped_reply(sel, asker)
    asker.close()
    assert len(server.clients) == server.max_clients and not any(closed_by_peer(s) for s in idle)
    # One accepted before its request arrives pushes out the oldest silent one, not itself.
    late = connect(path)
    pump(sel, lambda: closed_by_peer(idle[0]), "the oldest silent connection closed")
    assert len(server.clients) == server.max_clients and not any(closed_by_peer(s) for s in idle[1:])
    assert b'"pong": true' in pumped_reply(sel, late)
    late.close()
    # The oldest one wrote its request since its last read, and a newcomer is accepted
    # before the loop reads it (both ready in one turn, the listener first): answered, not
    # pushed out.
    idle[1].sendall(b'{"cmd": "ping"}\n')
    assert len(server.clients) == server.max_clients - 1  # ``late`` answered and gone
    newcomers = [connect(path) for _ in range(2)]  # a UNIX connect returns with its connection queued
    server._accept(selectors.EVENT_READ)
    idle[1].settimeout(10)
    assert b'"pong": true' in idle[1].recv(4096)
    assert len(server.clients) == server.max_clients and not any(closed_by_peer(s) for s in idle[2:])
    for s in newcomers:
        s.close()


def test_at_the_limit_with_every_slot_holding_half_a_request_the_oldest_goes_not_the_newcomer(full):
    # Slowloris: each held connection wrote the start of a request and stalls. The loop has not
    # read them yet when a real client is accepted: they are read, none is done, and the oldest
    # makes room, so the newcomer (whose request is on its way) is served.
    held = full.fill()
    for s in held:
        s.sendall(b'{"cmd": ')
    newcomer = connect(full.path)  # a UNIX connect returns with its connection queued
    full.server._accept(selectors.EVENT_READ)
    assert closed_by_peer(held[0]) and not any(closed_by_peer(s) for s in held[1:])
    assert b'"pong": true' in pumped_reply(full.sel, newcomer)
    newcomer.close()


@pytest.mark.parametrize("flood", ["silent", "half-written"])
def test_at_the_limit_the_peer_holding_the_most_connections_loses_one_before_an_older_one_of_another(full, flood):
    # The operator's CLI connected first and the scheduler has not let it write yet (a loaded
    # machine) while another process floods, silent or each connection with a request begun:
    # the oldest silent connection is the operator's, but the flood's own go first.
    server = full.server
    mine = full.fill(1)[0]
    full.hold_elsewhere(server.max_clients + 20, write=b'{"cmd": ' if flood == "half-written" else b"")
    assert {c.peer for c in server.clients.values()} == {os.getpid(), full.holder.pid}
    assert len(server.clients) == server.max_clients and not closed_by_peer(mine)
    assert b'"pong": true' in pumped_reply(full.sel, mine)


def test_at_the_limit_a_scraper_whose_host_holds_a_few_connections_is_not_taken_for_a_flood():
    # Many hosts hold one connection each; the scraper's host holds three, the scraper's the
    # newest of them. Newcomers from other hosts push out the oldest connections, as they
    # would with no peer rule: three is no flood, so the scraper is not the first to go.
    from supervisor.metrics import HttpExporter

    sel = selectors.DefaultSelector()
    server = HttpExporter("127.0.0.1:0", sel, lambda: "")
    host, port = server.listener.getsockname()
    held, others = [], iter(f"127.0.{1 + i // 250}.{1 + i % 250}" for i in range(1000))

    def open_from(source):
        s = socket.create_connection((host, port), source_address=(source, 0))
        s.setblocking(False)
        held.append(s)
        pump(sel, lambda: len(server.clients) == min(len(held), server.max_clients), "the connection accepted")
        return s

    try:
        for _ in range(server.max_clients - 3):
            open_from(next(others))
        open_from("127.0.0.2"), open_from("127.0.0.2")
        scraper = open_from("127.0.0.2")
        for _ in range(3):
            open_from(next(others))
        assert [closed_by_peer(s) for s in held[:3]] == [True] * 3
        assert not any(closed_by_peer(s) for s in held[3:])
        scraper.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        got = bytearray()

        def answered():
            with contextlib.suppress(BlockingIOError):
                got.extend(scraper.recv(4096))
            return got.endswith(b"\r\n\r\n") or b"\r\n\r\n" in got
        pump(sel, answered, "the scrape answered")
        assert got.startswith(b"HTTP/1.0 200"), bytes(got)
    finally:
        for s in held:
            s.close()
        server.close()
        sel.close()


def test_a_request_line_over_the_limit_is_refused_even_when_it_ends_within_one_read(tmp_path):
    sel = selectors.DefaultSelector()
    path = str(tmp_path / "s.sock")
    server = HealthServer(path, 0o600, sel, lambda req: {"ok": True, "pong": True})
    try:
        for pad, answer in ((65_000, b'"pong": true'), (66_000, b"request line over 65536 bytes")):
            s = connect(path)
            line = json.dumps({"cmd": "ping", "pad": "x" * pad}).encode()
            assert (len(line) > 65_536) == (pad > 65_536)
            s.sendall(line + b"\n")
            s.setblocking(False)
            got = bytearray()

            def answered():
                try:
                    got.extend(s.recv(4096))
                except BlockingIOError:
                    pass
                return got.endswith(b"\n")
            pump(sel, answered, "the reply")
            assert answer in got, got
            s.close()
    finally:
        server.close()
        sel.close()


def test_a_failure_answering_one_client_drops_that_client_only(tmp_path):
    class Broken(HealthServer):
        def answer(self, inbox):
            if b"boom" in inbox:
                raise RecursionError("maximum recursion depth exceeded")
            return super().answer(inbox)

    sel = selectors.DefaultSelector()
    path = str(tmp_path / "s.sock")
    server = Broken(path, 0o600, sel, lambda req: {"ok": True, "pong": True})
    bad, good = connect(path), connect(path)
    bad.setblocking(False)
    bad.sendall(b'{"cmd": "boom"}\n')
    good.sendall(b'{"cmd": "ping"}\n')
    got = bytearray()

    def served():
        for key, mask in sel.select(0.05):
            key.data(mask)
        good.setblocking(False)
        try:
            got.extend(good.recv(4096))
        except BlockingIOError:
            pass
        return closed_by_peer(bad) and got.endswith(b"\n")

    wait_for(served, message="the failing client dropped and the other answered")
    assert b'"pong": true' in got and not server.clients
    bad.close()
    good.close()
    server.close()
    sel.close()


# -- the socket path ---------------------------------------------------------------------------

def test_a_socket_path_that_is_a_regular_file_is_refused_and_kept(daemon):
    with open(daemon.socket, "w") as f:
        f.write("precious\n")
    result = tangguh("run", "-c", daemon.config_path)
    assert result.returncode == 2, result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and daemon.socket in errors[0] and "not a socket" in errors[0], result.stderr
    with open(daemon.socket) as f:
        assert f.read() == "precious\n"
    assert stat.S_ISREG(os.stat(daemon.socket).st_mode)


# -- results over the message limit ------------------------------------------------------------

def test_a_result_over_the_message_limit_dead_letters_the_job(daemon):
    daemon.start()
    job = daemon.wait_job(daemon.enqueue("huge_result", {}, max_attempts=5), timeout=60)
    assert (job.state, job.reason, job.attempt) == ("dead", "result_too_large", 1)
    assert "limit" in job.history[-1]["error"]["message"]
    assert daemon.status()["restarts"] == 0  # the child failed the job itself and stays
    serves_a_job(daemon)
    daemon.signal(signal.SIGTERM)
    assert daemon.wait_exit() == 0
    daemon.assert_clean()


def test_an_oversize_frame_from_a_child_kills_that_child_not_the_master(daemon):
    daemon.start()
    marker = daemon.marker("m")
    job = daemon.wait_job(daemon.enqueue("oversize_frame", {"marker": marker}, max_attempts=5), timeout=60)
    assert (job.state, job.reason, job.attempt) == ("dead", "result_too_large", 1)
    pid = int(read_lines(marker)[0][1])
    wait_for(lambda: pid not in daemon.worker_pids() and len(daemon.worker_pids()) == 2,
             message="the child killed and replaced")
    serves_a_job(daemon)
    daemon.signal(signal.SIGTERM)
    assert daemon.wait_exit() == 0
    daemon.assert_clean()


# -- metric labels ---------------------------------------------------------------------------------

def test_unknown_job_types_share_one_metric_label(daemon):
    daemon.start()
    total = 500
    daemon.broker.enqueue_many([NewJob(f"random-{i}-{os.urandom(4).hex()}", {}) for i in range(total)])
    wait_for(lambda: daemon.broker.stats(["default"])["default"].dead == total, timeout=120,
             message="every unknown type dead-lettered")
    serves_a_job(daemon)
    text = request(daemon.socket, {"cmd": "metrics"})["text"]
    types, dead = set(), {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if "type" in sample.labels:
                types.add(sample.labels["type"])
            if sample.name == "tangguh_jobs_dead_lettered_total":
                dead[sample.labels["type"], sample.labels["reason"]] = sample.value
    assert types == {"unknown", "noop"}, sorted(types)[:10]
    assert dead == {("unknown", "unknown_type"): total}
    assert daemon.status()["counters"]["dead"] == total
    daemon.assert_clean()


# -- handler edge cases --------------------------------------------------------------------------

def test_the_next_job_on_a_child_runs_under_the_signals_the_child_started_with(tmp_path):
    """A job that sets SIGPIPE to the default (a command-line idiom), ignores SIGCHLD or takes
    SIGHUP leaves the next job on its child as it found it: that job's write to a closed socket
    killed the child (the job counted crashed), and its subprocesses all returned 0."""
    d = Daemon(tmp_path, supervisor={"workers": 1})
    try:
        d.start()
        spoil, look = d.broker.enqueue_many([NewJob("signals", {"spoil": True}, priority=2),
                                             NewJob("signals", {}, priority=1)])
        spoiled, looked = d.wait_job(spoil), d.wait_job(look)
        assert spoiled.result["pid"] == looked.result["pid"]  # the same child, one job after the other
        assert looked.result == {"pid": spoiled.result["pid"], "pipe": "SIG_IGN", "hup_ignored": False,
                                 "false_exits": 1}
        d.assert_clean()
    finally:
        d.stop()


def test_the_next_job_on_a_child_has_the_stdin_stdout_and_stderr_the_child_started_with(tmp_path):
    """A job that closes fds 0-2 (a daemonising idiom) left the next job on its child without them:
    its print() failed with EBADF (the job dead as an OSError), its log lines were lost, and the
    next file it opened took fd 1 or 2 and got the child's log lines written into it."""
    d = Daemon(tmp_path, supervisor={"workers": 1})
    try:
        d.start()
        spoil, look = d.broker.enqueue_many([NewJob("std_fds", {"spoil": True}, priority=2),
                                             NewJob("std_fds", {}, priority=1)])
        spoiled, looked = d.wait_job(spoil), d.wait_job(look)
        assert spoiled.state == "done", spoiled.error
        assert looked.state == "done", looked.error
        assert looked.result == {"pid": spoiled.result["pid"], "open": [0, 1, 2]}  # the same child
        wait_for(lambda: "std_fds prints" in d.logs() and "std_fds logs" in d.logs())
        d.assert_clean()
    finally:
        d.stop()


def test_a_child_ended_by_a_real_time_signal_is_a_crash_and_the_master_serves_on(tmp_path):
    """A child a real-time signal ended (SIGRTMIN+6: no ``signal.Signals`` member names it) took the
    master down with it: "internal error: ValueError: 40 is not a valid Signals", every job of the
    supervisor left leased, and the job on its next claim did it again."""
    d = Daemon(tmp_path, handler_files=("testjobs.py", "hostile.py"))
    try:
        d.start()
        job = d.wait_job(d.enqueue("realtime_signal", {}, max_attempts=1))
        assert (job.state, job.reason) == ("dead", "crashed"), job
        assert "signal SIGRTMIN+6" in job.error["message"], job.error
        status = d.status()
        assert status["counters"]["crashed"] == 1 and status["restarts"] == 1
        serves_a_job(d)
        d.assert_clean()
    finally:
        d.stop()


def test_a_child_that_cannot_even_print_its_failure_exits_non_zero(daemon):
    """A job that closed every descriptor, its pipe and stderr among them: the child's reply
    failed, then so did printing why, before its exit code was set: "exit code 0" was recorded,
    which reads as a child that ended normally."""
    daemon.start()
    job = daemon.wait_job(daemon.enqueue("std_fds", {"all": True}, max_attempts=1))
    assert (job.state, job.reason) == ("dead", "crashed")
    assert job.error["message"] == "child died mid-job (exit code 1)", job.error
    serves_a_job(daemon)
    daemon.assert_clean()


# A process that ptrace-seizes a pid and holds it until its stdin closes: a debugger attached to a
# child. The child's death then goes to the tracer first; the master cannot reap it meanwhile, as
# while a child killed in uninterruptible sleep (a hung NFS read) has not died yet.
TRACER = """
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
print(libc.ptrace(0x4206, int(sys.argv[1]), 0, 0), flush=True)  # PTRACE_SEIZE
sys.stdin.read()
"""


def test_a_child_killed_past_its_hard_timeout_that_is_slow_to_die_does_not_spin_the_master(tmp_path):
    """Once the SIGKILL after the hard timeout's grace was sent, its instant stayed the loop's next
    wake-up, in the past: until the child was reaped the loop turned without sleeping, a CPU at
    100 % (a child in a hung NFS read, a debugger attached), sending SIGKILL each turn. Counted,
    not timed: each status request is a turn of the loop at least, and a turn that sends SIGKILL
    logs it (the master's CPU time over a window, as this test measured it, a loaded machine blurs)."""
    import psutil

    d = Daemon(tmp_path, supervisor={"workers": 1, "kill_grace": 0.2})
    tracer = None
    try:
        d.start()
        marker, release = d.marker("m"), d.marker("release")
        job_id = d.enqueue("hold", {"marker": marker, "release": release}, max_attempts=1, timeout=1.0)
        pid = int(wait_for(lambda: read_lines(marker), message="the job to start")[0][2])
        tracer = subprocess.Popen([sys.executable, "-c", TRACER, str(pid)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        if tracer.stdout.readline().strip() != "0":
            pytest.skip("ptrace is not allowed here")
        child = psutil.Process(pid)
        wait_for(lambda: child.status() == psutil.STATUS_ZOMBIE, message="the child killed past its hard timeout")
        for _ in range(10):  # the master serves meanwhile, ten turns of its loop at least
            assert d.status()["ok"]
        sigkills = d.records(event="timeout_sigkill", pid=pid)
        assert len(sigkills) == 1, f"SIGKILL sent {len(sigkills)} times: the loop turned on the past deadline"
        assert child.status() == psutil.STATUS_ZOMBIE  # not reaped yet all along: the tracer holds it
        tracer.stdin.close()  # detached: the master reaps the child now
        job = d.wait_job(job_id)
        assert (job.state, job.reason) == ("dead", "timeout"), job
        serves_a_job(d)
        d.assert_clean()
    finally:
        if tracer is not None:
            tracer.kill()
            tracer.wait()
        d.stop()


def test_an_exception_that_cannot_be_printed_is_an_exception_not_a_crash(daemon):
    daemon.start()
    job = daemon.wait_job(daemon.enqueue("unprintable", {}, max_attempts=2))
    assert (job.state, job.reason, job.attempt) == ("dead", "exception", 2)
    error = job.history[-1]["error"]
    assert error["class"] == "_Unprintable" and error["message"] == "<unprintable _Unprintable>", error
    status = daemon.status()
    assert status["restarts"] == 0 and status["counters"]["crashed"] == 0
    serves_a_job(daemon)
    daemon.assert_clean()


def test_a_huge_exception_message_is_stored_and_logged_cut_and_the_job_retries_as_usual(daemon):
    # A 4 MB message was sent whole, logged twice on one line and stored in every attempt's history.
    daemon.start()
    job = daemon.wait_job(daemon.enqueue("huge_error", {"size": 4_000_000}, max_attempts=2), timeout=60)
    assert (job.state, job.reason, job.attempt) == ("dead", "exception", 2)
    errors = [entry["error"] for entry in job.history if entry.get("error")] + [job.error]
    assert len(errors) == 3, job.history  # both attempts, then the dead job's own error
    for error in errors:
        assert error["class"] == "ValueError"
        assert error["message"].startswith("head-of-message xxx") and "characters cut" in error["message"]
        assert len(error["message"]) <= MAX_ERROR_MESSAGE + 100
        # The message is cut inside the traceback too, so every frame down to the raise is kept.
        assert error["traceback"].startswith("Traceback") and "in huge_error" in error["traceback"]
        assert "ValueError: head-of-message" in error["traceback"]
        assert len(error["traceback"]) <= MAX_ERROR_TRACEBACK + 100
    # A cause's message is not the job's: the traceback keeps its end, where the handler raised.
    job = daemon.wait_job(daemon.enqueue("huge_error", {"size": 10, "cause_size": 2_000_000}, max_attempts=1))
    assert job.error["traceback"].startswith("(") and "characters cut" in job.error["traceback"]
    assert job.error["traceback"].rstrip().endswith("ValueError: head-of-message xxxxxxxxxx")
    assert len(job.error["traceback"]) <= MAX_ERROR_TRACEBACK + 100
    lines = daemon.logs().splitlines()
    assert max(len(line) for line in lines) < 2 * MAX_ERROR_MESSAGE, "a log line holds the whole message"
    assert len(daemon.records(event="dead")) == 2 and len(daemon.records(event="retry")) == 1
    serves_a_job(daemon)
    daemon.assert_clean()


def test_error_info_cuts_text_from_any_path():
    error = error_info("exception", "E" * 10_000, "m" * 1_000_000, "t" * 1_000_000 + "raised here")
    assert error["class"].startswith("EEE") and len(error["class"]) <= MAX_ERROR_MESSAGE
    assert error["message"].startswith("mmm") and error["message"].endswith("(991808 characters cut)")
    assert error["traceback"].endswith("raised here") and error["traceback"].startswith("(")
    assert len(error["traceback"]) <= MAX_ERROR_TRACEBACK + 100
    assert error_info("exception", "E", "short", "tb") == {"reason": "exception", "class": "E", "message": "short",
                                                          "traceback": "tb"}


def test_a_max_rss_recycle_is_logged_with_its_reason(tmp_path):
    d = Daemon(tmp_path, supervisor={"max_child_rss_mb": 1})  # every child is over 1 MiB
    try:
        d.start()
        serves_a_job(d)
        recycles = wait_for(lambda: d.records(event="recycle"),
                            message="the recycle record")
        assert recycles[0]["reason"] == "max_rss" and "RSS" in recycles[0]["msg"], recycles[0]
        assert "after" not in recycles[0]["msg"]
        d.signal(signal.SIGTERM)
        assert d.wait_exit() == 0
        d.assert_clean()
    finally:
        d.stop()



def test_a_forged_result_with_numbers_no_float_holds_fails_its_attempt_and_the_master_serves_on(tmp_path):
    """A handler can reach the child's pipe. A RESULT whose delay or counter was 10**400 ended
    the master (OverflowError in the metrics, then in the retry delay), and every restart
    claimed the same job and ended again. Such values are dropped at the master's door: the
    attempt fails with the backoff's delay, the master serves on, and the retry runs."""
    d = Daemon(tmp_path, handler_files=("testjobs.py", "forged.py"), jobs={"backoff_base": 0.0})
    try:
        d.start()
        job = d.wait_job(d.enqueue("forges_its_result"))
        assert (job.state, job.attempt, job.result) == ("done", 2, {"attempt": 2})
        assert job.history[0]["outcome"] == "retry" and job.history[0]["error"]["reason"] == "exception"
        assert d.proc.poll() is None and d.status()["restarts"] == 0
        assert d.wait_job(d.enqueue("noop")).state == "done"
        d.assert_clean()
    finally:
        d.stop()


def test_a_forged_result_of_a_subnormal_duration_leaves_the_master_serving(tmp_path):
    """A handler's RESULT saying its job ran 5e-324 s became the type's average run time, and
    the next claim's prefetch divided by it: int(inf), and the master ended (restarted, it met
    the next such job the same way)."""
    d = Daemon(tmp_path, handler_files=("testjobs.py", "forged.py"), broker={"prefetch": "auto"})
    try:
        d.start()
        d.wait_job(d.enqueue("forges_a_tiny_duration"))
        for _ in range(3):  # claims after it, with the type's average measured
            assert d.wait_job(d.enqueue("noop")).state == "done"
        assert d.proc.poll() is None and d.status()["restarts"] == 0
        d.assert_clean()
    finally:
        d.stop()


def test_a_forged_lock_message_with_a_ttl_no_float_holds_is_ignored_and_the_master_serves_on(tmp_path, redis_url):
    """The same through a lock message: its TTL went through float(), and 10**400 raised."""
    d = Daemon(tmp_path, handler_files=("testjobs.py", "forged.py"), toolkit={"redis_url": redis_url})
    try:
        d.start()
        assert d.wait_job(d.enqueue("forges_a_lock")).state == "done"
        assert d.proc.poll() is None and d.status()["restarts"] == 0
        assert d.wait_job(d.enqueue("noop")).state == "done"
        assert len([r for r in d.records() if "malformed lock message" in r.get("msg", "")]) == 7
        d.assert_clean()
    finally:
        d.stop()


def test_a_thread_a_handler_module_starts_at_import_is_named_before_the_fork(tmp_path):
    """The master forks only while no other thread runs (a lock a thread holds at the fork
    stays held in every child, and a child taking it hangs until its hard timeout). A
    thread a handler module starts at import breaks that silently on Python 3.11: the
    master names it once, and serves on."""
    d = Daemon(tmp_path, handler_files=("testjobs.py", "importthread.py"))
    try:
        d.start()
        warned = wait_for(lambda: d.records(event="fork_beside_threads"), message="the thread named")
        assert len(warned) == 1 and "config-refresher" in warned[0]["msg"]
        assert d.wait_job(d.enqueue("refreshed")).state == "done"
        d.signal(signal.SIGTTIN)  # another fork beside the same thread: not said again
        wait_for(lambda: len(d.worker_pids()) == 3, message="a third child")
        assert len(d.records(event="fork_beside_threads")) == 1
    finally:
        d.stop()


def test_a_non_daemon_thread_a_handler_module_started_neither_hides_nor_keeps_the_stopped_master_alive(tmp_path):
    """Python waits for non-daemon threads at exit: a stopped master stayed up until systemd's
    SIGKILL. And a reload that imports the module again starts another thread of the same
    name: compared by name, it went unsaid."""
    d = Daemon(tmp_path, handler_files=("testjobs.py",))
    with open(os.path.join(d.handlers, "poller.py"), "w") as f:
        f.write("import threading\n\nthreading.Thread(target=threading.Event().wait, name='poller').start()\n")
    try:
        d.start()
        wait_for(lambda: d.records(event="fork_beside_threads"), message="the thread named")
        d.signal(signal.SIGHUP)
        wait_for(lambda: d.status()["generation"] == 2 and len(d.worker_pids()) == 2, message="generation 2")
        wait_for(lambda: len(d.records(event="fork_beside_threads")) == 2, message="the second thread named too")
        d.signal(signal.SIGTERM)
        assert d.proc.wait(timeout=30) == 0
        [record] = d.records(event="threads_left")
        assert record["msg"] == "not waiting for 2 thread(s) a handler module started: poller, poller"
    finally:
        d.stop()


def test_the_prune_chore_deletes_a_backlog_one_budget_per_loop_turn(tmp_path, monkeypatch):
    """One prune call deleted the whole backlog (12 us a job on SQLite: 800,000 old jobs left
    the health socket unanswered for 9.6 s). Now each loop turn deletes one budget and the
    next turn goes on, until a call comes back under budget."""
    import supervisor.backends.sqlite as sqlite_broker
    from supervisor import config
    from supervisor.master import periodic

    broker = sqlite_broker.SQLiteBroker(f"sqlite:///{tmp_path}/broker.db")
    broker.migrate()
    broker.enqueue_many([NewJob("t", {}) for _ in range(25)])
    for job in broker.claim(["default"], 25, 30, "w"):
        broker.ack(job.lease)
    calls = []
    link = type("Link", (), {"down": False, "call": lambda self, fn, what=None: calls.append(fn(broker)) or calls[-1]})()
    monkeypatch.setattr(periodic, "PRUNE_BUDGET", 10)
    monkeypatch.setattr(sqlite_broker, "PRUNE_BATCH", 5)
    chores = periodic.Periodic(config.from_dict({"broker": {"retention": 0.001}}), {}, link)
    chores.next_prune_at = 0.0  # due now (the first waits a minute after start)
    first = broker.now()
    wait_for(lambda: broker.now() > first + 0.01, message="the jobs past the retention")
    for _ in range(4):  # four loop turns
        chores.prune()
    assert calls == [10, 10, 5] and broker.stats(["default"])["default"].done == 0
    broker.close()


def test_a_start_that_fails_after_a_handler_module_started_a_thread_still_exits(tmp_path):
    """A handler file that fails to import after another started a non-daemon thread: the
    error was printed, then the process waited for that thread for ever (to systemd, running)."""
    d = Daemon(tmp_path, handler_files=("testjobs.py",))
    with open(os.path.join(d.handlers, "a_poller.py"), "w") as f:
        f.write("import threading\n\nthreading.Thread(target=threading.Event().wait, name='poller').start()\n")
    with open(os.path.join(d.handlers, "b_broken.py"), "w") as f:
        f.write("raise ValueError('broken at import')\n")
    try:
        d.start(wait=False)
        assert d.proc.wait(timeout=30) == 2
        assert "b_broken.py:1: ValueError: broken at import" in d.logs()
    finally:
        d.stop()
