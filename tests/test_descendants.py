"""The processes a job started end with its child: killed past its hard timeout, at a graceful
stop's deadline, or dead by its own hand. Orphaned, a `sleep 1000` (a converter, a
multiprocessing pool) ran on under init, held its files and ports, and piled up over months."""
import os
import signal

import psutil

from .daemon import Daemon, read_lines
from .util import wait_for

# Starts a helper that ignores SIGTERM (only a SIGKILL ends it), notes its pid, then the job
# outlives its hard timeout (the SIGTERM's JobTimeout swallowed) or its child leaves at once.
LEAVER = """\
import os, subprocess, time

import supervisor


@supervisor.job("leave_behind")
def leave_behind(ctx, payload):
    helper = subprocess.Popen(["sh", "-c", "trap '' TERM; exec sleep 1000"])
    with open(payload["marker"], "a") as f:
        f.write(f"{helper.pid} {os.getpid()}\\n")
    if payload.get("exit"):
        os._exit(3)
    while True:
        try:
            time.sleep(60)
        except BaseException:
            pass
"""


def gone(pid, created):
    """The process ended (reaped, or a zombie of init's); a pid taken since by another is gone too."""
    try:
        p = psutil.Process(pid)
        return p.create_time() != created or p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def leaver(tmp_path, **supervisor):
    d = Daemon(tmp_path, supervisor={"workers": 1, "kill_grace": 0.3, **supervisor})
    with open(os.path.join(d.handlers, "leaver.py"), "w") as f:
        f.write(LEAVER)
    return d


def started_helper(d, marker):
    line = wait_for(lambda: read_lines(marker), message="the job to start its helper")[0]
    helper, child = (int(pid) for pid in line)
    # Its `exec sleep` done: the trap's ignored SIGTERM is the sleep's own.
    wait_for(lambda: psutil.Process(helper).name() == "sleep", message="the helper to be a sleep")
    return helper, psutil.Process(helper).create_time(), child


def test_a_child_killed_past_its_hard_timeout_takes_what_its_job_started_with_it(tmp_path):
    d = leaver(tmp_path)
    try:
        d.start()
        marker = d.marker("m")
        job_id = d.enqueue("leave_behind", {"marker": marker}, max_attempts=1, timeout=1.0)
        helper, created, child = started_helper(d, marker)
        job = d.wait_job(job_id)
        assert (job.state, job.reason) == ("dead", "timeout"), job
        wait_for(lambda: child not in d.worker_pids() and len(d.worker_pids()) == 1, message="the child replaced")
        wait_for(lambda: gone(helper, created), timeout=5, message="the job's helper to end with its child")
        d.assert_clean()
    finally:
        d.stop()


def test_a_child_that_dies_by_itself_takes_what_its_job_started_with_it(tmp_path):
    d = leaver(tmp_path)
    try:
        d.start()
        marker = d.marker("m")
        job = d.wait_job(d.enqueue("leave_behind", {"marker": marker, "exit": True}, max_attempts=1))
        assert (job.state, job.reason) == ("dead", "crashed"), job
        helper, created, _ = started_helper(d, marker)
        wait_for(lambda: gone(helper, created), timeout=5, message="the job's helper to end with its child")
        d.assert_clean()
    finally:
        d.stop()


def test_a_child_killed_at_the_graceful_stop_deadline_takes_what_its_job_started_with_it(tmp_path):
    d = leaver(tmp_path, graceful_timeout=0.5)
    try:
        d.start()
        marker = d.marker("m")
        d.enqueue("leave_behind", {"marker": marker}, timeout=600.0)
        helper, created, _ = started_helper(d, marker)
        d.signal(signal.SIGTERM)
        assert d.wait_exit(30) == 0
        wait_for(lambda: gone(helper, created), timeout=5, message="the job's helper to end with the stop")
        d.assert_clean()
    finally:
        d.stop()


def pending(pid):
    """The signals pending for a process (its own and its thread group's), as a bit mask."""
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)
    return int(fields["SigPnd"], 16) | int(fields["ShdPnd"], 16)


def test_a_sigttin_to_every_process_of_the_service_stops_no_job_process(tmp_path):
    """`systemctl kill -s TTIN` signals every process of the unit. A child in a process group of
    its own inside the master's session (not orphaned) would have its job's processes stopped by
    it, where in the master's group they ignored it; a session of its own is an orphaned group."""
    d = leaver(tmp_path, graceful_timeout=0.5)
    try:
        d.start()
        marker = d.marker("m")
        d.enqueue("leave_behind", {"marker": marker}, timeout=600.0)
        helper, _, child = started_helper(d, marker)
        for pid in (d.proc.pid, child, helper):
            os.kill(pid, signal.SIGTTIN)
        bit = 1 << (signal.SIGTTIN - 1)
        wait_for(lambda: not pending(helper) & bit and not pending(child) & bit, message="SIGTTIN taken")
        assert psutil.Process(helper).status() != psutil.STATUS_STOPPED
        assert psutil.Process(child).status() != psutil.STATUS_STOPPED
        wait_for(lambda: d.status()["target_workers"] == 2, message="the master's SIGTTIN")
    finally:
        d.stop()
