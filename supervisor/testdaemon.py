"""A real supervisor for tests (``supervisor.testing``'s ``Supervisor`` and ``write_config``):
``tangguh run`` in a subprocess on a config of the test's own, checked when it stops."""
import os
import signal
import subprocess
import sys
import time

import tomli_w

from . import config as config_module, registry
from .model import FINISHED


def write_config(folder, handlers, **sections):
    """A config for a test: a SQLite broker, the socket and the given handlers folder in ``folder``;
    short backoffs; the queues the handlers name besides ``default``. ``sections`` add or override
    keys (``jobs={"max_attempts": 2}``)."""
    data = {
        "supervisor": {"workers": 2, "handlers": os.path.abspath(handlers), "socket": "tangguh.sock",
                       "graceful_timeout": 20.0},
        "broker": {"url": "sqlite:///broker.db", "lease_seconds": 5.0, "heartbeat_seconds": 0.5,
                   "queues": _queues_of(handlers)},
        "jobs": {"backoff_base": 0.1, "backoff_cap": 1.0, "jitter": 0.0},
    }
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    path = os.path.join(folder, "tangguh.toml")
    with open(path, "wb") as f:
        tomli_w.dump(data, f)
    return path


def _queues_of(handlers):
    """``default`` and every queue a handler's decorator names (``@job(..., queue="emails")``), so
    that such a handler's jobs can be enqueued and run in a test as under a daemon serving them."""
    from .testing import _imported_or_fresh

    try:
        specs = registry.load_handlers(os.fspath(handlers), importer=_imported_or_fresh)  # the test's own modules
    except registry.HandlerLoadError:
        specs = {}  # run_jobs and the supervisor name what does not import
    return ["default"] + sorted({s.queue for s in specs.values() if s.queue and s.queue != "default"})


class Supervisor:
    """``tangguh run`` in a subprocess (its own process group), driven through its socket and signals."""

    def __init__(self, config_path):
        self.config_path = config_path
        self.config = config_module.load(config_path)
        self.log_path = os.path.join(os.path.dirname(config_path), "supervisor.log")
        self.proc = None

    def start(self, timeout=30):
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "supervisor.cli", "run", "-c", self.config_path],
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            _wait(self._ready, timeout, "the supervisor to start its workers")
        except BaseException:
            # Nobody stops a supervisor whose start failed (a fixture that raised has no teardown),
            # and in a session of its own the test run's end does not reach it either.
            self._kill()
            raise
        return self

    def _ready(self):
        from .health import NoSupervisor, request

        if self.proc.poll() is not None:
            raise AssertionError(f"the supervisor exited with {self.proc.returncode}:\n{self.logs()}")
        try:
            status = request(self.config.supervisor.socket, {"cmd": "status"}, timeout=5)
        except (NoSupervisor, OSError, ValueError):
            return False
        return sum(1 for w in status["workers"] if w["state"] == "idle") >= status["target_workers"]

    def wait_job(self, job_id, states=FINISHED, timeout=30):
        """The job once it reaches one of ``states`` (default: finished, i.e. done, dead, cancelled or expired)."""
        from .backends.base import open_broker

        with open_broker(self.config.broker.url) as broker:
            seen = []

            def reached():
                job = broker.get(job_id)
                seen[:] = [job]
                return job is not None and job.state in states and job

            found = _wait(reached, timeout, f"job {job_id} to reach {states}", fail=False)
            if found is None:
                now = "not stored" if seen[0] is None else f"still {seen[0].state}"
                raise AssertionError(f"timed out after {timeout}s waiting for job {job_id} to reach {states}:"
                                     f" it is {now}")
            return found

    def logs(self):
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def stop(self, timeout=30):
        """SIGTERM, then check: exit 0, no job still leased, no process of the supervisor left."""
        if self.proc is None:
            return
        try:
            workers = _workers(self.proc.pid)  # each leads a session of its own: not in the group
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
            code = self.proc.wait(timeout)
            if code != 0:
                raise AssertionError(f"the supervisor exited with {code}:\n{self.logs()}")
            leftovers = _wait(lambda: not (_group_alive(self.proc.pid) or _any_alive(workers)) or None, 5,
                              "its workers to exit", fail=False)
            if leftovers is None:
                raise AssertionError("workers of the supervisor outlived it")
            from .backends.base import open_broker

            with open_broker(self.config.broker.url) as broker:
                stats = broker.stats(self.config.broker.queues)
            leased = {q: s.in_flight for q, s in stats.items() if s.in_flight}
            if leased:
                raise AssertionError(f"jobs still leased after the supervisor stopped: {leased}")
        finally:
            self._kill()

    def _kill(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)
        self.proc = None


def _workers(pid):
    """The processes the master ``pid`` runs now (its children and what their jobs started)."""
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _any_alive(processes):
    import psutil

    for p in processes:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:  # is_running: the pid not reused
                return True
        except psutil.Error:
            pass
    return False


def _group_alive(pgid):
    import psutil

    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                return True
        except (ProcessLookupError, psutil.Error):
            pass
    return False


def _wait(condition, timeout, what, fail=True):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            if fail:
                raise AssertionError(f"timed out after {timeout}s waiting for {what}")
            return None
        time.sleep(0.02)
