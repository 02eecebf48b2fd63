"""``supervisor.cpu_affinity``: "spread" pins each child to one CPU of the supervisor's, by
slot; "off" (the default) leaves them where the kernel puts them. Read from the kernel
(``sched_getaffinity`` of the real processes), not from the daemon's own account."""
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
    """The status rows of ``count`` live children of ``generation``, once they are all up."""
    def up():
        rows = [w for w in d.status()["workers"] if w["generation"] == generation and w["state"] != "starting"]
        return rows if len(rows) == count else None
    return wait_for(up, timeout=30, message=f"{count} workers of generation {generation}")


def assert_spread(d, workers, cpus):
    for w in workers:
        want = cpus[w["slot"] % len(cpus)]
        assert os.sched_getaffinity(w["pid"]) == {want}, (w, cpus)
        assert w["cpus"] == [want], w
    assert os.sched_getaffinity(d.proc.pid) == set(cpus), "the master itself is never pinned"


@needs_affinity
def test_spread_pins_each_child_to_its_slots_cpu_and_a_restarted_child_to_the_same(tmp_path):
    cpus = sorted(os.sched_getaffinity(0))
    workers = len(cpus) + 1  # one slot more than CPUs: the count wraps round
    d = Daemon(tmp_path, supervisor={"workers": workers, "cpu_affinity": "spread"})
    try:
        d.start()
        rows = workers_of_generation(d, 1, workers)
        assert_spread(d, rows, cpus)
        assert d.wait_job(d.enqueue("noop")).state == "done"
        # A child killed mid-life comes back in its slot, on its slot's CPU.
        victim = next(w for w in rows if w["slot"] == 1)
        os.kill(victim["pid"], signal.SIGKILL)
        back = wait_for(lambda: [w for w in d.status()["workers"]
                                 if w["slot"] == 1 and w["pid"] != victim["pid"] and w["state"] != "starting"],
                        timeout=30, message="worker 1 restarted")
        assert_spread(d, back, cpus)
        d.assert_clean()
    finally:
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
        assert d.wait_job(d.enqueue("noop")).state == "done"
        d.assert_clean()
    finally:
        d.stop()


def test_a_cpu_affinity_the_config_does_not_know_is_refused_by_name(tmp_path):
    path = tmp_path / "tangguh.toml"
    path.write_text('[supervisor]\ncpu_affinity = "all"\n')
    with pytest.raises(ConfigError) as err:
        config.load(str(path))
    assert "supervisor.cpu_affinity" in str(err.value) and "'spread'" in str(err.value), str(err.value)


def test_a_child_refused_its_pin_warns_and_runs_on(monkeypatch, caplog):
    from supervisor.child import worker as child

    def refuse(*_):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "sched_setaffinity", refuse)  # what a seccomp filter without it answers
    with caplog.at_level(logging.DEBUG, logger="tangguh.child"):
        child.place(0, "spread")
        child.place(0, "off")
    assert [(r.levelno, r.event) for r in caplog.records] == [(logging.WARNING, "cpu_affinity_refused")]
