"""``tangguh demo``: a one-command tour on a throwaway SQLite broker.

Starts a real supervisor with the example handlers, enqueues a mix of jobs,
SIGKILLs the child running one of them, and tells what became of every job:
done, done after retries, dead-lettered, recovered after the crash.
"""
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import tomli_w

from ..health import NoSupervisor, request
from ..model import NewJob
from .common import DATA

HANDLERS = os.path.join(DATA, "handlers")


def main():
    folder = tempfile.mkdtemp(prefix="tangguh-demo-")
    try:
        return Tour(folder).run()
    except TimeoutError as exc:
        print(f"tangguh: error: demo: {exc}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def wait_until(condition, what, timeout=30, interval=0.02):
    """Poll ``condition()`` until it returns something truthy; TimeoutError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out waiting for {what}")


class Tour:
    def __init__(self, folder):
        self.folder = folder
        self.socket = os.path.join(folder, "tangguh.sock")
        self.config = os.path.join(folder, "tangguh.toml")
        self.url = f"sqlite:///{folder}/broker.db"
        with open(self.config, "wb") as f:
            tomli_w.dump({
                "supervisor": {"workers": 2, "handlers": HANDLERS, "socket": self.socket},
                "broker": {"url": self.url, "lease_seconds": 10.0, "heartbeat_seconds": 1.0},
                "jobs": {"backoff_base": 0.3, "backoff_cap": 2.0, "max_attempts": 4},
                "log": {"format": "text", "level": "info"},
            }, f)

    def say(self, text):
        print(text, flush=True)

    def run(self):
        from ..backends import open_broker
        from .daemon import render_status

        self.say(f"Starting a supervisor with 2 children on {self.url}")
        log = open(os.path.join(self.folder, "daemon.log"), "wb")
        proc = subprocess.Popen([sys.executable, "-m", "supervisor.cli", "run", "-c", self.config],
                                stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_until(lambda: self.ping(proc), "the supervisor to start")
            broker = open_broker(self.url)
            jobs = {
                "hash_chain": broker.enqueue(NewJob("hash_chain", {"rounds": 200_000}, max_attempts=4)),
                "flaky": broker.enqueue(NewJob("flaky", {"failures": 2}, max_attempts=4)),
                "always_permanent": broker.enqueue(NewJob("always_permanent", {"why": "invoice is void"})),
                "sleep": broker.enqueue(NewJob("sleep", {"seconds": 2}, max_attempts=4)),
                "no_such_type": broker.enqueue(NewJob("no_such_type", {}, max_attempts=4)),
            }
            self.say(f"Enqueued {len(jobs)} jobs: " + ", ".join(jobs))
            victim = wait_until(lambda: self.worker_running(jobs["sleep"]), "the sleep job to start")
            os.kill(victim, signal.SIGKILL)
            self.say(f"SIGKILLed child {victim} in the middle of the sleep job")
            wait_until(lambda: all(broker.get(j).state in ("done", "dead") for j in jobs.values()),
                      "every job to finish", timeout=60)
            self.say("\nWhat happened to each job:")
            for name, job_id in jobs.items():
                self.say(f"  {name:<17} {story(broker.get(job_id))}")
            self.say("\nFinal status (tangguh status):")
            self.say(render_status(request(self.socket, {"cmd": "status"})))
            broker.close()
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
            log.close()
        self.say(f"\nSupervisor stopped with exit code {proc.returncode} (SIGTERM: graceful stop).")
        return 0 if proc.returncode == 0 else 1

    def ping(self, proc):
        if proc.poll() is not None:
            with open(os.path.join(self.folder, "daemon.log")) as f:
                raise SystemExit(f"tangguh: error: the supervisor exited ({proc.returncode}):\n{f.read()}")
        try:
            status = request(self.socket, {"cmd": "status"}, timeout=2)
        except (NoSupervisor, OSError):
            return False
        return sum(1 for w in status["workers"] if w["state"] == "idle") == 2

    def worker_running(self, job_id):
        for w in request(self.socket, {"cmd": "status"})["workers"]:
            if w["job_id"] == job_id:
                return w["pid"]
        return None



def story(job):
    """One line on what became of a job, from its attempt history."""
    outcomes = [h.get("outcome") for h in job.history]
    crashed = [h for h in job.history if (h.get("error") or {}).get("reason") == "crashed"]
    if job.state == "done":
        if crashed:
            return f"done on attempt {job.attempt}: recovered after its child was killed ({crashed[0]['error']['message']})"
        if job.attempt > 1:
            return f"done on attempt {job.attempt}, after {outcomes.count('retry')} retries with backoff"
        return f"done on attempt 1 -> {job.result}"
    return f"dead-lettered after {job.attempt} attempt(s): {job.reason}: {job.error.get('message')}"
