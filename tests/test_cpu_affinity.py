"""``supervisor.cpu_affinity``: "spread" pins each child to one CPU of the supervisor's, the one
the fewest live children hold; "off" (the default) leaves them where the kernel puts them. Read
from the kernel (``sched_getaffinity`` of the real processes), not from the daemon's account."""
import errno
import logging
import os
import signal

import pytest

from supervisor import config
from supervisor.errors import ConfigError

from .daemon import Daemon
from .util import wait_for

needs_affinity = pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity on this OS")


def workers_of_generation(d, generation, count):
    """The status rows of the ``count`` children of ``generation`` once they are up and no other
    child is left (a retired one still finishing, a replacement still starting)."""
    def up():
        rows = d.status()["workers"]
        ok = len(rows) == count and all(w["generation"] == generation and w["state"] in ("idle", "busy")
                                        for w in rows)
        return rows if ok else None
    return wait_for(up, timeout=30, message=f"{count} workers of generation {generation} and no other")


def pins(rows):
    """{pid: its one CPU}, read from the kernel; each child must be pinned to exactly one."""
    out = {}
    for w in rows:
        affinity = os.sched_getaffinity(w["pid"])
        assert len(affinity) == 1 and w["cpus"] == sorted(affinity), (w, affinity)
        out[w["pid"]] = next(iter(affinity))
    return out


def assert_spread(d, rows, cpus):
    """Every child on one CPU of ``cpus``, as evenly as they go; the master on all of them."""
    held = [list(pins(rows).values()).count(cpu) for cpu in cpus]
    assert set(pins(rows).values()) <= set(cpus) and max(held) - min(held) <= 1, (rows, cpus, held)
    assert os.sched_getaffinity(d.proc.pid) == set(cpus), "the master itself is never pinned"


@needs_affinity
def test_spread_pins_the_children_one_to_a_cpu_and_a_restarted_child_to_the_cpu_it_frees(tmp_path):
    cpus = sorted(os.sched_getaffinity(0))
    workers = len(cpus) + 1  # one child more than CPUs: they go round
    d = Daemon(tmp_path, supervisor={"workers": workers, "cpu_affinity": "spread"})
    try:
        d.start()
        rows = workers_of_generation(d, 1, workers)
        assert_spread(d, rows, cpus)
        assert {w["slot"]: pins([w])[w["pid"]] for w in rows} == {n: cpus[n % len(cpus)] for n in range(workers)}
        assert d.wait_job(d.enqueue("noop")).state == "done"
        victim = next(w for w in rows if w["slot"] == 1)
        os.kill(victim["pid"], signal.SIGKILL)
        wait_for(lambda: victim["pid"] not in {w["pid"] for w in d.status()["workers"]}, timeout=30,
                 message="the killed child reaped")
        back = workers_of_generation(d, 1, workers)
        assert_spread(d, back, cpus)
        (new,) = [w for w in back if w["pid"] not in {r["pid"] for r in rows}]
        assert pins([new])[new["pid"]] == cpus[1 % len(cpus)], "the replacement takes the CPU its predecessor left"
        d.assert_clean()
    finally:
        d.stop()


@needs_affinity
def test_spread_holds_across_recycles(tmp_path):
    """A recycled child's replacement starts while the child finishes its last job: it must
    take the CPU that child leaves, not pile onto a CPU another live child holds."""
    cpus = sorted(os.sched_getaffinity(0))
    d = Daemon(tmp_path, supervisor={"workers": 2, "cpu_affinity": "spread", "max_jobs_per_child": 1})
    try:
        d.start()
        for _ in range(6):
            assert d.wait_job(d.enqueue("noop")).state == "done"
            assert_spread(d, workers_of_generation(d, 1, 2), cpus)
        assert len(d.records(event="recycle")) >= 6
    finally:
        d.stop()


def start_on_two_cpus(d):
    """Start ``d`` on the first two CPUs of ours (as ``taskset`` would): the arrangements below
    are counted for two."""
    cpus = sorted(os.sched_getaffinity(0))[:2]
    if len(cpus) < 2:
        pytest.skip("the arrangement needs two CPUs")
    d.start(preexec_fn=lambda: os.sched_setaffinity(0, set(cpus)))
    return cpus


def hold_jobs(d, count):
    """``count`` jobs that run until the returned file exists, and the status rows of their children."""
    release = d.marker("release")
    jobs = [d.enqueue("hold", {"release": release, "max_wait": 60}) for _ in range(count)]
    busy = wait_for(lambda: rows_where(d, count, state="busy"), timeout=30, message=f"{count} busy children")
    return release, jobs, busy


def let_go(d):
    """End the held jobs, so that a failed test does not wait out the graceful stop on them."""
    open(d.marker("release"), "a").close()


def rows_where(d, count, **match):
    """The status rows of the children that match, once there are ``count`` of them (else None)."""
    rows = [w for w in d.status()["workers"] if all(w[k] == v for k, v in match.items())]
    return rows if len(rows) == count else None


def replace(d, rows, slot, count):
    """SIGKILL the child in ``slot`` and wait for its replacement: it moves to the end of the master's
    table of children, which is the order the master hands out jobs and retires children in."""
    pid = next(w["pid"] for w in rows if w["slot"] == slot)
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: pid not in d.worker_pids(), timeout=30, message=f"worker {slot} reaped")
    return workers_of_generation(d, 1, count)


@needs_affinity
def test_sigttou_retires_a_child_from_the_cpu_the_most_hold(tmp_path):
    """Three children on two CPUs (0, 1, 0), the one in slot 2 busy: retiring the idle child of
    slot 1, the last one on its CPU, would leave two on one CPU and none on the other."""
    d = Daemon(tmp_path, supervisor={"workers": 3, "cpu_affinity": "spread"})
    try:
        cpus = start_on_two_cpus(d)
        rows = workers_of_generation(d, 1, 3)
        for slot in (0, 1):  # slot 2 first in the master's table: the next job goes to it
            rows = replace(d, rows, slot, 3)
        release, jobs, busy = hold_jobs(d, 1)
        assert [w["slot"] for w in busy] == [2] and pins(busy) == {busy[0]["pid"]: cpus[0]}, busy
        d.signal(signal.SIGTTOU)
        wait_for(lambda: len(d.status()["workers"]) == 2, timeout=30, message="one child retired")
        assert_spread(d, d.status()["workers"], cpus)
        open(release, "w").close()
        assert [d.wait_job(j).state for j in jobs] == ["done"]
        assert_spread(d, workers_of_generation(d, 1, 2), cpus)
        d.assert_clean()
    finally:
        let_go(d)
        d.stop()


@needs_affinity
def test_a_reload_while_old_children_run_spreads_the_new_generation(tmp_path):
    """Four children on two CPUs, the two on CPU 0 busy at a reload: they are retiring, so the
    new generation is placed as if they were gone, two on each CPU."""
    d = Daemon(tmp_path, supervisor={"workers": 4, "cpu_affinity": "spread"})
    try:
        cpus = start_on_two_cpus(d)
        replace(d, workers_of_generation(d, 1, 4), 1, 4)  # slots 0 and 2 (CPU 0) take the jobs
        release, jobs, busy = hold_jobs(d, 2)
        assert set(pins(busy).values()) == {cpus[0]}, busy
        d.signal(signal.SIGHUP)
        new = wait_for(lambda: rows_where(d, 4, generation=2, state="idle"), timeout=30,
                       message="the new generation up")
        held = [list(pins(new).values()).count(cpu) for cpu in cpus]
        open(release, "w").close()
        assert [d.wait_job(j).state for j in jobs] == ["done", "done"]
        assert held == [2, 2], (new, held)
        assert_spread(d, workers_of_generation(d, 2, 4), cpus)
        d.assert_clean()
    finally:
        let_go(d)
        d.stop()


@needs_affinity
def test_spread_stays_within_the_cpus_the_supervisor_was_given(tmp_path):
    """``taskset`` or systemd's ``CPUAffinity=`` narrow the master's set: the children are spread over it."""
    given = [sorted(os.sched_getaffinity(0))[-1]]
    d = Daemon(tmp_path, supervisor={"workers": 2, "cpu_affinity": "spread"})
    try:
        d.start(preexec_fn=lambda: os.sched_setaffinity(0, set(given)))
        assert_spread(d, workers_of_generation(d, 1, 2), given)
    finally:
        d.stop()


@needs_affinity
def test_off_leaves_every_child_free_and_a_reload_to_spread_pins_the_new_generation(tmp_path):
    cpus = sorted(os.sched_getaffinity(0))
    d = Daemon(tmp_path, supervisor={"workers": 2})
    try:
        d.start()
        for w in workers_of_generation(d, 1, 2):
            assert os.sched_getaffinity(w["pid"]) == set(cpus) and w["cpus"] == cpus, w
        d.config["supervisor"]["cpu_affinity"] = "spread"
        d.write_config()
        d.signal(signal.SIGHUP)
        assert_spread(d, workers_of_generation(d, 2, 2), cpus)
        # Another reload while pinned, then a crash: the new children spread, and so does the replacement.
        d.signal(signal.SIGHUP)
        rows = workers_of_generation(d, 3, 2)
        assert_spread(d, rows, cpus)
        os.kill(rows[0]["pid"], signal.SIGKILL)
        wait_for(lambda: rows[0]["pid"] not in {w["pid"] for w in d.status()["workers"]}, timeout=30,
                 message="the killed child reaped")
        assert_spread(d, workers_of_generation(d, 3, 2), cpus)
        assert d.wait_job(d.enqueue("noop")).state == "done"
        d.assert_clean()
    finally:
        d.stop()


def test_status_of_a_child_already_gone_has_no_cpus():
    """The heartbeat thread reads the children's view while the main loop may reap one."""
    import socket
    import subprocess

    from supervisor.master.pool import Child
    from supervisor.master.status import child_view

    gone = subprocess.Popen(["true"])
    gone.wait()
    a, b = socket.socketpair()
    try:
        view = child_view(Child(0, gone.pid, a, 1))
    finally:
        a.close()
        b.close()
    assert view["cpus"] is None and view["rss_bytes"] is None, view


def test_a_cpu_affinity_the_config_does_not_know_is_refused_by_name(tmp_path):
    path = tmp_path / "tangguh.toml"
    path.write_text('[supervisor]\ncpu_affinity = "all"\n')
    with pytest.raises(ConfigError) as err:
        config.load(str(path))
    assert "supervisor.cpu_affinity" in str(err.value) and "'spread'" in str(err.value), str(err.value)


def test_a_child_refused_its_pin_warns_and_runs_on(monkeypatch, caplog):
    from supervisor.child import worker as child

    def refuse(*_):
        raise OSError(errno.EINVAL, "Invalid argument")  # the CPU left the cpuset since the master chose it

    monkeypatch.setattr(os, "sched_setaffinity", refuse)
    with caplog.at_level(logging.DEBUG, logger="tangguh.child"):
        child.place(0, 1)
        child.place(0, None)
    assert [(r.levelno, r.event) for r in caplog.records] == [(logging.WARNING, "cpu_affinity_refused")]
