"""Tangguh under systemd: the notify protocol from a real ``tangguh run``, the unit file, the installer.

A test binds its own datagram socket and hands its address to the daemon as
``NOTIFY_SOCKET``, playing PID 1: it sees every READY/STATUS/WATCHDOG/
RELOADING/STOPPING message the real process sends. The unit-file tests run
``systemd-analyze`` (Debian package ``systemd``), which needs no running
systemd.
"""
import logging
import os
import re
import resource
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import uuid

import pytest

from supervisor import childlimits
from supervisor.sdnotify import Notifier

from .daemon import Daemon
from .util import wait_for

WATCHDOG_USEC = 200_000  # pings every 0.1 s: many of them within a short test

ENV_PROBE = '''
import os
import subprocess

import supervisor

NAMES = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


@supervisor.job("env_probe")
def env_probe(ctx, payload):
    """What a child and a program it starts see of systemd's variables."""
    inherited = subprocess.run(["env"], capture_output=True, text=True, check=True).stdout.splitlines()
    return {"pid": os.getpid(),
            "environ": sorted(n for n in NAMES if n in os.environ),
            "subprocess": sorted(line.split("=", 1)[0] for line in inherited if line.split("=", 1)[0] in NAMES)}
'''


class FakeSystemd:
    """The receiving end of ``NOTIFY_SOCKET``: collects every datagram, in order."""

    def __init__(self, address):
        self.address = address  # as the daemon sees it: a path or "@name"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + address[1:] if address.startswith("@") else address)
        self.sock.setblocking(False)
        self.messages = []  # each a list of "KEY=value" lines

    def drain(self):
        while True:
            try:
                data = self.sock.recv(65536)
            except BlockingIOError:
                return self.messages
            self.messages.append(data.decode().split("\n"))

    def lines(self):
        return [line for message in self.drain() for line in message]

    def count(self, line):
        return self.lines().count(line)

    def index(self, line, after=-1):
        """Position (in lines()) of the first ``line`` after position ``after``; None if absent."""
        lines = self.lines()
        return next((i for i in range(after + 1, len(lines)) if lines[i] == line), None)

    def wait(self, line, after=-1, timeout=15):
        return wait_for(lambda: self.index(line, after) is not None and self.index(line, after) + 1,
                        timeout=timeout, message=f"{line!r} on the notify socket") - 1

    def close(self):
        self.sock.close()


def fake_systemd(kind, tmp_path, monkeypatch):
    address = str(tmp_path / "notify.sock") if kind == "path" else f"@tangguh-test-{uuid.uuid4().hex}"
    fake = FakeSystemd(address)
    # The daemon subprocess inherits the environment, as it would from PID 1.
    monkeypatch.setenv("NOTIFY_SOCKET", address)
    monkeypatch.setenv("WATCHDOG_USEC", str(WATCHDOG_USEC))
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    return fake


@pytest.fixture(params=["path", "abstract"])
def systemd(request, tmp_path, monkeypatch):
    """A fake PID 1 on a path socket, then on an abstract one."""
    fake = fake_systemd(request.param, tmp_path, monkeypatch)
    yield fake
    fake.close()


@pytest.fixture
def notify(tmp_path, monkeypatch):
    """A fake PID 1 on a path socket only (for tests where the address kind does not matter)."""
    fake = fake_systemd("path", tmp_path, monkeypatch)
    yield fake
    fake.close()


@pytest.fixture
def daemon(tmp_path):
    d = Daemon(tmp_path)
    with open(os.path.join(d.handlers, "envprobe.py"), "w") as f:
        f.write(ENV_PROBE)
    yield d
    d.stop()


def test_ready_comes_with_the_children_the_system_lets_it_fork(notify, daemon):
    """Started under a descriptor limit too low for every child (``LimitNOFILE=``): the
    master serves with the children it could fork, and READY must say so, not wait for
    the rest. Waiting, systemd's start timeout killed a master that was serving."""
    daemon.config["supervisor"]["workers"] = 30
    daemon.write_config()
    limit = childlimits.DESCRIPTOR_RESERVE + 24  # the master's own descriptors and a few children
    daemon.start(wait=False, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit)))
    notify.wait("READY=1", timeout=30)
    message = next(m for m in notify.messages if "READY=1" in m)
    status = next(line for line in message if line.startswith("STATUS="))
    assert re.search(r"forks refused: \d+ of 30 workers", status), status
    served = daemon.status()
    assert 1 <= len(served["workers"]) < 30 and served["target_workers"] == 30
    assert daemon.wait_job(daemon.enqueue("noop")).state == "done"
    daemon.signal(signal.SIGTERM)
    assert daemon.wait_exit() == 0


def test_the_watchdog_is_pinged_before_the_masters_own_import_at_a_reload(notify, daemon, monkeypatch):
    """The master's own import of a reload's modules holds the loop as long as the trial's took;
    the last ping could be nearly half a period old by then, so a slow import (import_timeout
    raised) passed WatchdogSec= and systemd killed a master that was reloading. A ping now goes
    just before that import: between RELOADING=1 and READY=1, with pings due only every 300 s."""
    monkeypatch.setenv("WATCHDOG_USEC", str(600_000_000))
    daemon.start()
    ready = notify.wait("READY=1")
    daemon.signal(signal.SIGHUP)
    reloading = notify.wait("RELOADING=1", after=ready)
    reloaded = notify.wait("READY=1", after=reloading)
    assert notify.lines()[reloading:reloaded].count("WATCHDOG=1") == 1
    daemon.signal(signal.SIGTERM)
    assert daemon.wait_exit() == 0


def test_ready_status_watchdog_reload_and_stopping_in_order(systemd, daemon):
    daemon.start()
    ready = systemd.wait("READY=1")
    # READY carries the one-line summary, and it comes once the children are up.
    message = next(m for m in systemd.messages if "READY=1" in m)
    assert any(line.startswith("STATUS=gen 1: 2 workers, 0 busy") for line in message), message
    wait_for(lambda: systemd.lines()[ready:].count("WATCHDOG=1") >= 5, message="five watchdog pings after READY")

    # A good reload: RELOADING=1 with MONOTONIC_USEC in one datagram, then READY=1.
    daemon.config["supervisor"]["workers"] = 3
    daemon.write_config()
    before_usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    daemon.signal(signal.SIGHUP)
    reloading = systemd.wait("RELOADING=1", after=ready)
    message = next(m for m in systemd.messages if "RELOADING=1" in m)
    usec = [int(line.split("=", 1)[1]) for line in message if line.startswith("MONOTONIC_USEC=")]
    assert len(usec) == 1 and before_usec <= usec[0] <= before_usec + 60_000_000
    reloaded = systemd.wait("READY=1", after=reloading)
    wait_for(lambda: any(line.startswith("STATUS=gen 2: 3 workers") for line in systemd.lines()[reloaded:]),
             message="STATUS of generation 2 with 3 workers")

    # A broken reload: RELOADING=1 then READY=1 all the same; the old generation serves.
    with open(daemon.config_path, "a") as f:
        f.write("\n[bogus]\n")
    daemon.signal(signal.SIGHUP)
    failed = systemd.wait("RELOADING=1", after=reloaded)
    failed_ready = systemd.wait("READY=1", after=failed)
    wait_for(lambda: any("last reload failed" in line for line in systemd.lines()[failed:] if line.startswith("STATUS=")),
             message="STATUS saying the last reload failed")
    assert daemon.status()["generation"] == 2 and daemon.proc.poll() is None
    wait_for(lambda: systemd.lines()[failed_ready:].count("WATCHDOG=1") >= 2, message="pings after the failed reload")

    daemon.signal(signal.SIGTERM)
    assert daemon.wait_exit() == 0
    lines = systemd.lines()
    stopping = systemd.index("STOPPING=1")
    assert stopping is not None and stopping > failed_ready
    assert lines.count("READY=1") == 3 and lines.count("RELOADING=1") == 2 and lines.count("STOPPING=1") == 1
    assert not [line for line in lines if not line.split("=", 1)[0] in (
        "READY", "STATUS", "WATCHDOG", "RELOADING", "MONOTONIC_USEC", "STOPPING")], lines
    daemon.assert_clean()


def test_children_and_their_subprocesses_never_see_the_notify_variables(notify, daemon):
    systemd = notify
    daemon.start()
    systemd.wait("READY=1")
    results = []
    for _ in range(4):  # both children, most likely; each answers for itself
        job = daemon.wait_job(daemon.enqueue("env_probe", max_attempts=1))
        assert job.state == "done", job
        results.append(job.result)
    assert {r["pid"] for r in results} <= set(daemon.worker_pids())
    assert all(r["environ"] == [] and r["subprocess"] == [] for r in results), results
    # The master still talks to systemd; the children hold no datagram socket at all.
    import psutil

    def dgram_sockets(pid):
        return [c for c in psutil.Process(pid).net_connections(kind="unix") if c.type == socket.SOCK_DGRAM]

    assert len(dgram_sockets(daemon.proc.pid)) == 1
    for pid in daemon.worker_pids():
        assert dgram_sockets(pid) == [], pid
    daemon.assert_clean()


def test_watchdog_stops_while_the_main_loop_is_stalled_and_resumes_after(notify, daemon):
    """A real stall: the test holds the SQLite broker's write lock, so the main loop's
    next claim blocks inside the broker call (busy timeout 30 s) while the heartbeat
    thread runs on. Pings sent from anywhere but the main loop would continue."""
    systemd = notify
    daemon.start()
    systemd.wait("READY=1")
    wait_for(lambda: systemd.count("WATCHDOG=1") >= 3, message="watchdog pings")
    db = sqlite3.connect(daemon.broker_url[len("sqlite:///"):], isolation_level=None, timeout=30)
    try:
        db.execute("BEGIN EXCLUSIVE")

        def silent_for(seconds):
            # True once no ping has arrived for ``seconds`` (ten watchdog periods).
            before = systemd.count("WATCHDOG=1")
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                time.sleep(0.05)
                if systemd.count("WATCHDOG=1") != before:
                    return False
            return True

        wait_for(lambda: silent_for(1.0), timeout=10, message="the pings to stop while the loop is blocked")
        assert daemon.proc.poll() is None
        stalled_at = len(systemd.lines())
    finally:
        db.execute("COMMIT")
        db.close()
    wait_for(lambda: systemd.lines()[stalled_at:].count("WATCHDOG=1") >= 3, message="pings to resume")
    assert daemon.wait_job(daemon.enqueue("noop")).state == "done"
    daemon.assert_clean()


def test_watchdog_keeps_pinging_while_the_broker_is_down(tmp_path, monkeypatch):
    """An unreachable broker is STATUS news, not a reason for systemd to kill the pool."""
    fake = FakeSystemd(f"@tangguh-test-{uuid.uuid4().hex}")
    monkeypatch.setenv("NOTIFY_SOCKET", fake.address)
    monkeypatch.setenv("WATCHDOG_USEC", str(WATCHDOG_USEC))
    d = Daemon(tmp_path, broker_url="redis://127.0.0.1:1/0")  # nothing listens on port 1
    try:
        d.start()
        wait_for(lambda: d.status()["broker_down"], message="the broker to be reported down")
        fake.wait("READY=1")
        assert any(line.startswith("STATUS=") and "BROKER DOWN" in line for line in fake.lines())
        seen = fake.count("WATCHDOG=1")
        wait_for(lambda: fake.count("WATCHDOG=1") >= seen + 5, message="pings while the broker is down")
        assert d.status()["broker_down"]
        d.signal(signal.SIGTERM)
        assert d.wait_exit() == 0
        assert fake.count("STOPPING=1") == 1
    finally:
        d.stop()
        fake.close()


# -- the notifier alone ------------------------------------------------------------------

def test_notifier_is_inert_without_notify_socket():
    n = Notifier({"WATCHDOG_USEC": "200000"})
    assert not n.enabled and n.watchdog_every is None and n.next_ping_at() is None
    n.ready("x"), n.status("y"), n.reloading(), n.watchdog(), n.stopping(), n.close()  # no error, nothing sent


@pytest.mark.parametrize("env, every", [
    ({"WATCHDOG_USEC": "200000"}, 0.1),
    ({"WATCHDOG_USEC": "200000", "WATCHDOG_PID": "1"}, None),  # another process is meant to ping
    ({"WATCHDOG_USEC": "0"}, None),
    ({"WATCHDOG_USEC": "soon"}, None),
    ({}, None),
])
def test_notifier_watchdog_period(tmp_path, env, every):
    fake = FakeSystemd(str(tmp_path / "n.sock"))
    n = Notifier({"NOTIFY_SOCKET": fake.address, **env})
    assert n.enabled and n.watchdog_every == every
    n.watchdog()
    n.watchdog()  # the second is within the half period: not sent
    assert fake.count("WATCHDOG=1") == (1 if every else 0)
    n.close(), fake.close()


@pytest.mark.parametrize("address", ["relative.sock", "@", "vsock:2:1234"])
def test_notifier_ignores_addresses_it_cannot_use(address):
    assert not Notifier({"NOTIFY_SOCKET": address}).enabled


def test_notifier_never_blocks_on_a_full_socket(tmp_path):
    fake = FakeSystemd(str(tmp_path / "full.sock"))
    n = Notifier({"NOTIFY_SOCKET": fake.address})
    deadline = time.monotonic() + 10
    for i in range(5000):  # far more than a datagram queue holds; nobody reads
        n.status(f"status {i}")
    assert time.monotonic() < deadline
    assert 0 < len(fake.drain()) < 5000
    n.close(), fake.close()


def test_the_main_loop_wakes_up_in_time_for_the_next_ping(tmp_path):
    """An idle loop sleeps up to a second; a WatchdogSec= under two seconds needs it to wake sooner."""
    from supervisor import config
    from supervisor.master import Arbiter

    fake = FakeSystemd(str(tmp_path / "n.sock"))
    arbiter = Arbiter(config.from_dict({}, str(tmp_path)), {})
    arbiter.pool.target = 0  # no children to spawn: only the ping is due
    assert arbiter.next_wakeup() > 0.5
    arbiter.status.notifier = Notifier({"NOTIFY_SOCKET": fake.address, "WATCHDOG_USEC": str(WATCHDOG_USEC)})
    arbiter.status.notifier.watchdog()
    assert 0 < arbiter.next_wakeup() <= WATCHDOG_USEC / 2e6
    arbiter.status.notifier.close(), fake.close()


# -- the health socket's group ---------------------------------------------------------------

def other_group():
    """A group other than ours that exists here (Debian always has ``daemon``, ``adm``...)."""
    import grp

    mine = set(os.getgroups()) | {os.getgid()}
    if os.geteuid() != 0:  # without root we may only chown to our own groups
        candidates = [grp.getgrgid(g) for g in mine if g != os.getgid()]
    else:
        candidates = [g for g in grp.getgrall() if g.gr_gid not in mine]
    if not candidates:
        pytest.skip("no second group this user may give a file to")
    return candidates[0]


def test_socket_group_is_validated():
    from supervisor import config
    from supervisor.errors import ConfigError

    assert config.from_dict({}).supervisor.socket_group == ""
    assert config.from_dict({"supervisor": {"socket_group": "tangguh-ops"}}).supervisor.socket_group == "tangguh-ops"
    for bad in (" ops", "-ops", "a b", 12, "x" * 40):
        with pytest.raises(ConfigError, match="^supervisor.socket_group: expected a group name"):
            config.from_dict({"supervisor": {"socket_group": bad}})


def test_health_socket_gets_its_mode_and_group(tmp_path):
    from supervisor.health import claim_path

    group = other_group()
    path = str(tmp_path / "h.sock")
    sock = claim_path(path, 0o660, group.gr_name)
    try:
        st = os.stat(path)
        assert (oct(st.st_mode & 0o777), st.st_gid) == (oct(0o660), group.gr_gid)
    finally:
        sock.close()
    plain = str(tmp_path / "plain.sock")
    claim_path(plain, 0o600).close()
    assert (oct(os.stat(plain).st_mode & 0o777), os.stat(plain).st_gid) == (oct(0o600), os.getegid())


def test_a_daemon_gives_its_socket_to_socket_group_and_refuses_an_unknown_group(tmp_path):
    group = other_group()
    d = Daemon(tmp_path / "good", supervisor={"socket_group": group.gr_name})
    try:
        d.start()
        assert os.stat(d.socket).st_gid == group.gr_gid and os.stat(d.socket).st_mode & 0o777 == 0o660
        assert d.status()["ok"]
    finally:
        d.stop()
    bad = Daemon(tmp_path / "bad", supervisor={"socket_group": "no-such-group-here"})
    try:
        bad.start(wait=False)
        assert bad.wait_exit() == 2  # a config error: systemd must not restart it (RestartPreventExitStatus=2)
        assert "supervisor.socket_group: cannot give" in bad.logs() and "no such group" in bad.logs()
        assert not os.path.exists(bad.socket)
    finally:
        bad.stop()


# -- the unit file ---------------------------------------------------------------------------

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UNIT_PATH = os.path.join(ROOT, "systemd", "tangguh.service")
SECURITY_THRESHOLD = 2.0  # systemd-analyze security's exposure, 0 (best) to 10; ours is 1.5
VENV_TANGGUH = os.path.join(os.path.dirname(sys.executable), "tangguh")
# Where a service's venv goes. Not this one's: a checkout under /tmp or a home (CI's, a
# developer's) is refused as an ExecStart= the unit's PrivateTmp= and ProtectHome= would hide.
SERVICE_TANGGUH = "/opt/tangguh/venv/bin/tangguh"


def unit_settings(text):
    """[(section, key, value)] in file order (keys may repeat, so no configparser)."""
    out, section = [], None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        out.append((section, key.strip(), value.strip()))
    return out


def setting(text, key, section="Service"):
    values = [v for s, k, v in unit_settings(text) if (s, k) == (section, key)]
    assert len(values) == 1, f"{section}.{key}: {values}"
    return values[0]


def systemd_analyze():
    path = shutil.which("systemd-analyze") or ("/usr/bin/systemd-analyze" if os.path.exists(
        "/usr/bin/systemd-analyze") else None)
    if path is None:
        message = "systemd-analyze not found: install the Debian package `systemd` (apt-get install systemd)"
        if os.environ.get("TANGGUH_REQUIRE_SERVICES") == "1":
            pytest.fail(f"TANGGUH_REQUIRE_SERVICES=1 but {message}")
        pytest.skip(message)
    return path


@pytest.fixture
def rendered_unit(tmp_path):
    """The unit as the installer writes it, with ExecStart= naming this venv's tangguh.

    ``systemd-analyze verify`` checks that the ExecStart= binary exists, and
    /opt/tangguh/venv does not exist on a test machine.
    """
    from supervisor.cli import install

    assert os.access(VENV_TANGGUH, os.X_OK), VENV_TANGGUH
    path = tmp_path / "tangguh.service"
    path.write_text(install.unit_text(VENV_TANGGUH))
    return str(path)


def test_packaged_unit_is_identical_to_the_systemd_one():
    from supervisor.cli import install

    with open(UNIT_PATH) as a, open(os.path.join(install.DATA, "tangguh.service")) as b:
        assert a.read() == b.read(), "copy systemd/tangguh.service to supervisor/data/ (they must stay identical)"


def test_systemd_analyze_verify_prints_nothing(rendered_unit):
    result = subprocess.run([systemd_analyze(), "verify", rendered_unit], capture_output=True, text=True, timeout=60)
    # verify exits 0 on many mistakes (an unknown Type=, a misspelt key): its output is the verdict.
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


def test_systemd_analyze_verify_would_catch_a_mistake(rendered_unit):
    """The check above is not vacuous: the same run flags an option this systemd does not know."""
    with open(rendered_unit, "a") as f:
        f.write("[Service]\nProtectSystm=strict\n")
    result = subprocess.run([systemd_analyze(), "verify", rendered_unit], capture_output=True, text=True, timeout=60)
    assert "ProtectSystm" in result.stdout + result.stderr


def test_systemd_analyze_security_scores_the_unit_under_the_threshold(rendered_unit):
    result = subprocess.run([systemd_analyze(), "security", "--offline=yes", "--no-pager",
                             f"--threshold={int(SECURITY_THRESHOLD * 10)}", rendered_unit],
                            capture_output=True, text=True, timeout=60)
    match = re.search(r"Overall exposure level for \S+: ([0-9.]+)", result.stdout)
    assert match, result.stdout + result.stderr
    assert float(match.group(1)) <= SECURITY_THRESHOLD and result.returncode == 0, result.stdout


def test_the_unit_agrees_with_the_config_defaults_and_the_installer():
    from supervisor import config, master as arbiter
    from supervisor.cli import install

    with open(UNIT_PATH) as f:
        text = f.read()
    defaults = config.from_dict({}).supervisor
    assert setting(text, "Type") == "notify" and setting(text, "NotifyAccess") == "main"
    # SIGTERM to the master only; it needs graceful_timeout + kill_grace + its last broker writes.
    assert setting(text, "KillMode") == "mixed" and setting(text, "KillSignal") == "SIGTERM"
    assert float(setting(text, "TimeoutStopSec")) > defaults.graceful_timeout + defaults.kill_grace + 10
    assert setting(text, "ExecReload") == "/bin/kill -HUP $MAINPID"
    assert setting(text, "Restart") == "on-failure"
    assert str(arbiter.EXIT_CONFIG) in setting(text, "RestartPreventExitStatus").split()
    # Broker calls block the loop up to 30 s (SQLite busy timeout, Redis socket timeout).
    assert float(setting(text, "WatchdogSec")) > 30
    assert setting(text, "OOMPolicy") == "continue"  # a child's OOM kill is ours to handle
    assert setting(text, "ExecStart").split()[1:] == ["run", "-c", install.CONFIG]
    # The paths the installed config uses are the ones systemd makes writable for the service.
    assert setting(text, "ProtectSystem") == "strict"
    assert install.SOCKET.startswith("/run/" + setting(text, "RuntimeDirectory") + "/")
    assert install.STATE_DIR == "/var/lib/" + setting(text, "StateDirectory")
    assert setting(text, "WorkingDirectory") == install.STATE_DIR
    assert (setting(text, "User"), setting(text, "Group")) == ("tangguh", "tangguh")
    assert defaults.socket_mode & 0o060 == 0o060 and defaults.socket_mode & 0o007 == 0  # group yes, others no
    assert setting(text, "WantedBy", "Install") == "multi-user.target"


# -- the installer ---------------------------------------------------------------------------

def tangguh_cli(*args):
    return subprocess.run([VENV_TANGGUH, *args], capture_output=True, text=True, timeout=60)


def test_config_init_systemd_installs_into_a_root(tmp_path):
    import grp
    import pwd

    from supervisor import config
    from supervisor.cli import install

    user = pwd.getpwuid(os.geteuid()).pw_name
    group = other_group() if os.geteuid() == 0 else grp.getgrgid(os.getegid())
    root = tmp_path / "root"
    result = tangguh_cli("config", "init", "--systemd", "--root", str(root), "--user", user, "--group", group.gr_name,
                         "--exec", SERVICE_TANGGUH)
    assert result.returncode == 0, result.stderr

    def stat(path):
        st = os.stat(root / path.lstrip("/"))
        return oct(st.st_mode & 0o7777), st.st_gid

    assert stat("/etc/tangguh") == (oct(0o750), group.gr_gid)
    assert stat("/etc/tangguh/config.toml") == (oct(0o640), group.gr_gid)
    assert stat("/etc/tangguh/handlers") == (oct(0o750), group.gr_gid)
    assert stat("/etc/systemd/system/tangguh.service")[0] == oct(0o644)
    assert os.listdir(root / "etc/tangguh/handlers") == []
    assert not (root / "var").exists() and not (root / "run").exists()  # systemd makes those from the unit
    # The config is the example with the service's paths; it is valid.
    cfg = config.load(str(root / "etc/tangguh/config.toml"))
    assert (cfg.supervisor.handlers, cfg.supervisor.socket) == (install.HANDLERS, install.SOCKET)
    assert cfg.broker.url == f"sqlite:///{install.STATE_DIR}/tangguh.db"
    unit = (root / "etc/systemd/system/tangguh.service").read_text()
    assert setting(unit, "ExecStart") == f"{SERVICE_TANGGUH} run -c {install.CONFIG}"
    assert install.default_tangguh_bin() == VENV_TANGGUH  # with no --exec: this venv's
    assert (setting(unit, "User"), setting(unit, "Group")) == (user, group.gr_name)
    assert "systemctl enable --now tangguh" in result.stdout

    # Again: an operator's config and handlers are kept, the unit is brought up to date.
    (root / "etc/tangguh/config.toml").write_text("[supervisor]\nworkers = 8\n")
    (root / "etc/tangguh/handlers/mine.py").write_text("# mine\n")
    (root / "etc/systemd/system/tangguh.service").write_text("stale\n")
    result = tangguh_cli("config", "init", "--systemd", "--root", str(root), "--user", user, "--group", group.gr_name,
                         "--exec", SERVICE_TANGGUH)
    assert result.returncode == 0, result.stderr
    assert (root / "etc/tangguh/config.toml").read_text() == "[supervisor]\nworkers = 8\n"
    assert (root / "etc/tangguh/handlers/mine.py").read_text() == "# mine\n"
    assert (root / "etc/systemd/system/tangguh.service").read_text() == unit
    assert "kept the existing" in result.stdout


def test_config_init_systemd_dry_run_prints_the_plan_and_touches_nothing(tmp_path):
    root = tmp_path / "root"
    result = tangguh_cli("config", "init", "--systemd", "--dry-run", "--root", str(root), "--exec", SERVICE_TANGGUH,
                         "--user", "tangguh-test-nobody", "--group", "tangguh-test-nogroup")
    assert result.returncode == 0, result.stderr
    # Under --root no account is made, dry run or not: the plan says so.
    assert "skipped under --root (accounts belong to the running system): groupadd --system tangguh-test-nogroup" \
        in result.stdout and "would run" not in result.stdout
    left = "group left as is: no group tangguh-test-nogroup here; the target system's installation sets it"
    assert f"would write {root}/etc/tangguh/config.toml (mode 0640, {left})" in result.stdout  # as the real run
    assert f"would write {root}/etc/systemd/system/tangguh.service (mode 0644)" in result.stdout
    assert not root.exists()
    # On the running system it would make them.
    result = tangguh_cli("config", "init", "--systemd", "--dry-run", "--exec", SERVICE_TANGGUH,
                         "--user", "tangguh-test-nobody", "--group", "tangguh-test-nogroup")
    assert result.returncode == 0, result.stderr
    assert "would run: groupadd --system tangguh-test-nogroup" in result.stdout
    assert ("would run: useradd --system --gid tangguh-test-nogroup --home-dir /var/lib/tangguh --no-create-home"
            " --shell /usr/sbin/nologin") in result.stdout
    assert "would write /etc/tangguh/config.toml (mode 0640, group tangguh-test-nogroup)" in result.stdout


def test_config_init_systemd_into_a_root_without_the_group_writes_the_files_for_the_target_system(tmp_path):
    # For a package: the group is the target system's, made by its installation. This one
    # failed after making half the tree, while its --dry-run had predicted success.
    root = tmp_path / "root"
    result = tangguh_cli("config", "init", "--systemd", "--root", str(root), "--exec", SERVICE_TANGGUH,
                         "--user", "tangguh-test-nobody", "--group", "tangguh-test-nogroup")
    assert result.returncode == 0, result.stderr
    assert "group left as is: no group tangguh-test-nogroup here" in result.stdout
    for path in ("etc/tangguh/config.toml", "etc/systemd/system/tangguh.service"):
        assert (root / path).is_file()
    assert os.stat(root / "etc/tangguh/config.toml").st_gid == os.getegid()


@pytest.mark.parametrize("args, error", [
    (["config", "init"], "config init: give the PATH to write, or --systemd"),
    (["config", "init", "--systemd", "x.toml"], "takes no PATH"),
    (["config", "init", "--systemd", "--exec", "/home/me/venv/bin/tangguh", "--dry-run"], "ProtectHome=yes"),
    # docs/service.md: /tmp and /var/tmp are hidden too (PrivateTmp=yes): the unit started, 203/EXEC.
    (["config", "init", "--systemd", "--exec", "/tmp/venv/bin/tangguh", "--dry-run"], "PrivateTmp=yes"),
    (["config", "init", "--systemd", "--exec", "/var/tmp/venv/bin/tangguh", "--dry-run"], "PrivateTmp=yes"),
    # Written into the unit as they came: ExecStart= split the path, expanded %b, or a newline in
    # --user added an ExecStartPre= of the caller's choosing.
    (["config", "init", "--systemd", "--exec", "/opt/my venv/bin/tangguh", "--dry-run"], "would split, quote"),
    (["config", "init", "--systemd", "--exec", "/opt/a%b$c/tangguh", "--dry-run"], "would split, quote"),
    (["config", "init", "--systemd", "--exec", "/opt/tangguh/venv/bin/tangguh", "--user",
      "svc\nExecStartPre=/bin/sh -c true", "--dry-run"], "--user"),
    (["config", "init", "--systemd", "--exec", "/opt/tangguh/venv/bin/tangguh", "--group", "Wheel Group",
      "--dry-run"], "--group"),
    # Unset variables: not the default account, nor the current folder for the root.
    (["config", "init", "--systemd", "--exec", "/opt/tangguh/venv/bin/tangguh", "--user", "", "--dry-run"], "--user"),
    (["config", "init", "--systemd", "--exec", "/opt/tangguh/venv/bin/tangguh", "--root", "", "--dry-run"],
     "--root needs a folder"),
])
def test_config_init_systemd_refuses_bad_invocations(args, error):
    result = tangguh_cli(*args)
    # Bad input, exit 2 as everywhere (a bad --exec, --user or --group exited 1, as a failed useradd does).
    assert result.returncode == 2 and error in result.stderr and result.stderr.count("\n") == 1, result.stderr


@pytest.mark.parametrize("option", [["--dry-run"], ["--root", "/srv/x"], ["--user", "svc"], ["--group", "svc"],
                                    ["--exec", "/opt/tangguh/venv/bin/tangguh"]])
def test_config_init_of_a_path_refuses_the_options_of_systemd(tmp_path, option):
    """`config init PATH --dry-run` wrote the file all the same; --root, --user... were dropped without a word."""
    target = tmp_path / "t.toml"
    result = tangguh_cli("config", "init", str(target), *option)
    assert result.returncode == 2 and f"config init: {option[0]} only goes with --systemd" in result.stderr
    assert result.stderr.count("\n") == 1 and os.listdir(tmp_path) == []


def syscalls(analyze, name, seen=None):
    """The system calls a SystemCallFilter= item names, groups expanded (systemd-analyze syscall-filter)."""
    if not name.startswith("@"):
        return {name}
    seen = set() if seen is None else seen
    if name in seen:
        return set()
    seen.add(name)
    listing = subprocess.run([analyze, "syscall-filter", name], capture_output=True, text=True, timeout=60,
                             check=True).stdout
    out = set()
    for line in listing.splitlines()[1:]:
        item = line.strip()
        if item and not item.startswith("#"):
            out |= syscalls(analyze, item, seen)
    return out


def test_the_unit_lets_the_children_use_sched_batch_and_cpu_pinning_and_nothing_else_of_resources():
    """systemd.exec(5): the first SystemCallFilter= line sets the kind (here an allow list);
    later lines with ~ remove their calls from it, lines without add theirs."""
    analyze = systemd_analyze()
    with open(UNIT_PATH) as f:
        lines = [v for s, k, v in unit_settings(f.read()) if (s, k) == ("Service", "SystemCallFilter")]
    assert not lines[0].startswith("~")
    allowed = set()
    for value in lines:
        names = set().union(*(syscalls(analyze, n) for n in value.lstrip("~").split()))
        allowed = allowed - names if value.startswith("~") else allowed | names
    resources = syscalls(analyze, "@resources")
    assert "sched_setscheduler" in resources and "sched_setscheduler" in allowed
    assert allowed & resources == {"sched_setscheduler", "sched_setaffinity"}
    assert {"setpriority", "setrlimit", "nice", "sched_setattr"} <= resources


def test_systemd_reads_the_filter_the_same_way(rendered_unit):
    result = subprocess.run([systemd_analyze(), "security", "--offline=yes", "--no-pager", rendered_unit],
                            capture_output=True, text=True, timeout=60)
    (line,) = [line for line in result.stdout.splitlines() if "SystemCallFilter=~@resources" in line]
    assert "sched_setscheduler is allowed" in line or "sched_setaffinity is allowed" in line, line


def test_a_child_says_at_debug_when_sched_batch_is_refused(monkeypatch, caplog):
    from supervisor.child import worker as child

    def refuse(*_):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "sched_setscheduler", refuse)  # what the seccomp filter answers
    with caplog.at_level(logging.DEBUG, logger="tangguh.child"):
        child.batch_scheduling()
    assert [r.event for r in caplog.records] == ["sched_batch_refused"]
    assert "SCHED_BATCH refused" in caplog.records[0].getMessage()


# -- the web console's unit ---------------------------------------------------------------

WEB_UNIT_PATH = os.path.join(ROOT, "systemd", "tangguh-web.service")


@pytest.fixture
def rendered_web_unit(tmp_path):
    with open(WEB_UNIT_PATH) as f:
        text = f.read()
    assert "ExecStart=/opt/tangguh/venv/bin/tangguh web -c /etc/tangguh/config.toml" in text
    path = tmp_path / "tangguh-web.service"
    path.write_text(text.replace("/opt/tangguh/venv/bin/tangguh", VENV_TANGGUH))
    return str(path)


def test_the_web_units_verify_prints_nothing_and_it_scores_under_the_threshold(rendered_web_unit):
    result = subprocess.run([systemd_analyze(), "verify", rendered_web_unit], capture_output=True, text=True,
                            timeout=60)
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")
    result = subprocess.run([systemd_analyze(), "security", "--offline=yes", "--no-pager",
                             f"--threshold={int(SECURITY_THRESHOLD * 10)}", rendered_web_unit],
                            capture_output=True, text=True, timeout=60)
    match = re.search(r"Overall exposure level for \S+: ([0-9.]+)", result.stdout)
    assert match, result.stdout + result.stderr
    assert float(match.group(1)) <= SECURITY_THRESHOLD and result.returncode == 0, result.stdout


def test_the_web_unit_does_not_restart_on_a_config_error_and_stops_within_its_timeout():
    with open(WEB_UNIT_PATH) as f:
        text = f.read()
    assert setting(text, "RestartPreventExitStatus") == "2"  # `tangguh web` exits 2 on a bad or unsafe config
    assert setting(text, "User") == "tangguh" and setting(text, "StateDirectory") == "tangguh"
    assert int(setting(text, "TimeoutStopSec")) > 2  # uvicorn's graceful shutdown (app.serve) is 2 s
