"""A real ``tangguh run`` in a subprocess, driven only through files, the socket and signals."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import psutil
import tomli_w

from supervisor.backends import open_broker
from supervisor.health import NoSupervisor, request
from supervisor.model import NewJob

from .util import wait_for

HERE = os.path.dirname(os.path.abspath(__file__))


def tangguh(*args, timeout=30, **kw):
    """Run the real CLI; return the CompletedProcess."""
    return subprocess.run([sys.executable, "-m", "supervisor.cli", *args], capture_output=True, text=True,
                          timeout=timeout, **kw)


class Daemon:
    def __init__(self, tmp_path, broker_url=None, handler_files=("testjobs.py",), **sections):
        self.dir = str(tmp_path)
        self.handlers = os.path.join(self.dir, "handlers")
        os.makedirs(self.handlers, exist_ok=True)
        for name in handler_files:  # files from tests/handlers/ to serve
            shutil.copy(os.path.join(HERE, "handlers", name), self.handlers)
        self.socket = os.path.join(self.dir, "tangguh.sock")
        self.broker_url = broker_url or f"sqlite:///{self.dir}/broker.db"
        self.config_path = os.path.join(self.dir, "tangguh.toml")
        self.log_path = os.path.join(self.dir, "daemon.log")
        self.proc = None
        self.config = {
            "supervisor": {"workers": 2, "handlers": self.handlers, "socket": self.socket, "graceful_timeout": 20.0},
            "broker": {"url": self.broker_url, "lease_seconds": 5.0, "heartbeat_seconds": 0.5},
            "jobs": {"backoff_base": 0.1, "backoff_cap": 1.0, "jitter": 0.0, "max_attempts": 3},
            "log": {"level": "debug", "format": "json"},
        }
        for section, values in sections.items():
            self.config.setdefault(section, {}).update(values)
        self.write_config()
        self._broker = None

    def write_config(self, config=None):
        with open(self.config_path, "wb") as f:
            tomli_w.dump(config or self.config, f)

    # -- life --------------------------------------------------------------------
    def start(self, wait=True, preexec_fn=None):
        self.log = open(self.log_path, "ab")
        # Own process group: cleanup can kill the master and every child at once.
        self.proc = subprocess.Popen([sys.executable, "-m", "supervisor.cli", "run", "-c", self.config_path],
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env=daemon_env(), preexec_fn=preexec_fn)
        if wait:
            wait_for(self.ready, timeout=30, message="supervisor to answer ping with its children up")
        return self

    def ready(self):
        if self.proc.poll() is not None:
            raise AssertionError(f"supervisor exited with {self.proc.returncode}:\n{self.logs()}")
        try:
            status = self.status()
        except (NoSupervisor, OSError, ValueError):
            return False
        return sum(1 for w in status["workers"] if w["state"] == "idle") >= status["target_workers"]

    def status(self):
        return request(self.socket, {"cmd": "status"}, timeout=5)

    def signal(self, sig):
        os.kill(self.proc.pid, sig)

    def signal_every_process(self, sig):
        """``sig`` to every process of the daemon, as ``systemctl kill`` sends it to the unit's cgroup:
        the master's group (a child forked an instant ago is still in it), then each child and what
        its job started by pid (a child leads a session of its own: a killpg of the master's misses it)."""
        os.killpg(self.proc.pid, sig)
        try:
            descendants = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            return
        for p in descendants:
            try:
                os.kill(p.pid, sig)
            except ProcessLookupError:
                pass

    def wait_exit(self, timeout=30):
        return self.proc.wait(timeout)

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        self.kill_group()
        if self._broker is not None:
            self._broker.close()

    def kill_group(self):
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for pid in self.group():  # each child leads a session of its own, with what its jobs started
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass

    def logs(self):
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def records(self, **match):
        """The daemon's JSON log records whose fields equal ``match`` (other lines, e.g. tracebacks, skipped)."""
        out = []
        for line in self.logs().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and all(record.get(k) == v for k, v in match.items()):
                out.append(record)
        return out

    # -- processes ----------------------------------------------------------------------
    def group(self):
        """Live processes of the daemon: its process group (the master), and each child's session
        (a child leads one, and what its jobs start is in it)."""
        sessions = {r["pid"] for r in self.records(event="spawn")}
        out = []
        for p in psutil.process_iter(["pid", "status"]):
            try:
                ours = os.getpgid(p.pid) == self.proc.pid or os.getsid(p.pid) in sessions
                if ours and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p.pid)
            except (ProcessLookupError, psutil.Error):
                pass
        return out

    def worker_pids(self):
        return [w["pid"] for w in self.status()["workers"]]

    # -- jobs -----------------------------------------------------------------------------
    @property
    def broker(self):
        if self._broker is None:
            self._broker = open_broker(self.broker_url)
        return self._broker

    def enqueue(self, type_, payload=None, **kw):
        return self.broker.enqueue(NewJob(type_, payload or {}, **kw))

    def job(self, job_id):
        return self.broker.get(job_id)

    def wait_job(self, job_id, states=("done", "dead"), timeout=30):
        return wait_for(lambda: (j := self.job(job_id)) is not None and j.state in states and j,
                        timeout=timeout, message=f"job {job_id} to reach {states}")

    def marker(self, name):
        return os.path.join(self.dir, name)

    def assert_clean(self, queues=("default",)):
        """The end of every process test: nothing leased, no child left alive, no fork beside a thread."""
        assert FORK_WARNING not in self.logs(), "the master forked while another thread was running"
        stats = self.broker.stats(list(queues))
        assert all(s.in_flight == 0 for s in stats.values()), f"jobs still leased: {stats}"
        if self.proc is not None and self.proc.poll() is not None:
            wait_for(lambda: not self.group(), timeout=5, message="no process of the daemon left alive")


# Python 3.12+ warns when a multi-threaded process forks. As an error the
# warning is swallowed by os.fork(), so the daemon is told to always print it
# and the tests read it back from the log instead.
FORK_WARNING = "use of fork() may lead to deadlocks"


def daemon_env():
    env = dict(os.environ)
    filters = [f for f in env.get("PYTHONWARNINGS", "").split(",") if f]
    env["PYTHONWARNINGS"] = ",".join(filters + ["always:This process:DeprecationWarning"])
    return env


def read_lines(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [line.split() for line in f if line.strip()]


def now():
    return time.time()
