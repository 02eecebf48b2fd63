"""The supervisor as a real process: real forks, real signals, real kills.

Each test starts ``tangguh run`` on a temporary SQLite broker, drives it only
through the broker, the health socket and signals, and ends with
``assert_clean`` (nothing leased, no process left).
"""
import contextlib
import json
import os
import re
import signal
import socket
import time
from types import SimpleNamespace

import psutil
import pytest

from supervisor import childlimits
from supervisor.checks import MAX_WORKERS
from supervisor.master.pool import Pool

from .daemon import Daemon, read_lines, tangguh
from .util import wait_for


@pytest.fixture
def daemon(tmp_path):
    d = Daemon(tmp_path)
    yield d
    d.stop()


def start(d):
    return d.start()


def test_jobs_flow_and_status_reports_children(daemon):
    daemon.start()
    ids = [daemon.enqueue("noop", {"i": i}) for i in range(20)]
    for job_id in ids:
        assert daemon.wait_job(job_id).state == "done"
    status = daemon.status()
    assert status["counters"]["succeeded"] == 20
    assert len(status["workers"]) == 2
    assert {w["state"] for w in status["workers"]} == {"idle"}
    assert sum(w["jobs_done"] for w in status["workers"]) == 20
    assert all(w["rss_bytes"] > 0 for w in status["workers"])
    done = daemon.job(ids[0])
    assert done.result == {"attempt": 1}
    assert done.history[-1]["pid"] in daemon.worker_pids()
    daemon.signal(signal.SIGTERM)
    assert daemon.wait_exit() == 0
    daemon.assert_clean()


def test_child_killed_mid_job_is_rerun_and_replaced(daemon):
    daemon.start()
    marker, release = daemon.marker("m"), daemon.marker("release")
    job_id = daemon.enqueue("hold", {"marker": marker, "release": release})
    started = wait_for(lambda: read_lines(marker), message="job to start")
    victim = int(started[0][2])
    os.kill(victim, signal.SIGKILL)
    # Ends when the job runs again, or fails at once if the crash finished it instead.
    wait_for(lambda: len(read_lines(marker)) >= 2 or daemon.job(job_id).state in ("done", "dead"),
             message="job to run again")
    assert len(read_lines(marker)) >= 2, daemon.job(job_id)
    open(release, "w").close()
    job = daemon.wait_job(job_id)
    assert (job.state, job.attempt) == ("done", 2)
    assert job.history[0]["outcome"] == "retry" and job.history[0]["error"]["reason"] == "crashed"
    assert "SIGKILL" in job.history[0]["error"]["message"]
    status = daemon.status()
    assert status["restarts"] == 1 and status["counters"]["crashed"] == 1
    assert victim not in daemon.worker_pids() and len(daemon.worker_pids()) == 2
    daemon.signal(signal.SIGTERM)
    assert daemon.wait_exit() == 0
    daemon.assert_clean()


def test_hard_timeout_kills_the_child_and_jobs_keep_flowing(tmp_path):
    d = Daemon(tmp_path, jobs={"timeout": 1.0}, supervisor={"graceful_timeout": 3.0})
    try:
        d.start()
        marker = d.marker("m")
        job_id = d.enqueue("spin", {"marker": marker}, max_attempts=1)
        pid = int(wait_for(lambda: read_lines(marker), message="spin to start")[0][2])
        t0 = time.monotonic()
        # The limit is 1 s plus the 0.5 s SIGTERM grace; allow 1 s more for a loaded machine.
        wait_for(lambda: not _alive(pid), timeout=3.5, message="the spinning child to be killed")
        assert time.monotonic() - t0 < 3.5
        job = d.wait_job(job_id)
        assert (job.state, job.reason) == ("dead", "timeout")
        assert job.history[-1]["error"]["class"] == "HardTimeout"
        after = d.enqueue("noop")
        assert d.wait_job(after).state == "done"
        assert d.status()["counters"]["timeouts"] == 1
        d.signal(signal.SIGTERM)
        assert d.wait_exit() == 0
        d.assert_clean()
    finally:
        d.stop()


def test_soft_timeout_raises_job_timeout_inside_the_handler(daemon):
    daemon.start()
    marker = daemon.marker("m")
    job_id = daemon.enqueue("soft_timeout", {"marker": marker}, max_attempts=1)
    job = daemon.wait_job(job_id)
    assert (job.state, job.reason) == ("dead", "timeout")
    assert job.error["class"] == "JobTimeout"
    lines = [" ".join(x) for x in read_lines(marker)]
    assert lines[0].endswith("deadline=True") and "saw JobTimeout" in lines
    assert len(daemon.status()["workers"]) == 2
    daemon.assert_clean()


def test_poison_job_is_retried_with_growing_delays_then_dead_lettered(daemon):
    daemon.start()
    marker = daemon.marker("m")
    job_id = daemon.enqueue("poison", {"marker": marker}, max_attempts=4)

    def dead_within_its_attempts():
        j = daemon.job(job_id)
        assert j.attempt <= 4, f"attempt {j.attempt} of a job with max_attempts 4"
        return j.state == "dead" and j

    job = wait_for(dead_within_its_attempts, message="the poison job to be dead-lettered")
    assert (job.attempt, job.reason) == (4, "exception")
    assert [h["outcome"] for h in job.history] == ["retry", "retry", "retry", "dead"]
    assert "ValueError: poison attempt 4" in job.error["traceback"]
    assert len(read_lines(marker)) == 4
    # backoff_base 0.1 with no jitter: each attempt waited at least 0.1, 0.2, 0.4 s after the
    # previous one ended (broker clock, broker history), less the retry write's own round trip.
    # A lower bound: a busy machine only makes the gaps longer.
    gaps = [b["started_at"] - a["ended_at"] for a, b in zip(job.history, job.history[1:])]
    assert all(gap >= delay - 0.05 for gap, delay in zip(gaps, (0.1, 0.2, 0.4))), gaps
    out = tangguh("dlq", "show", job_id, "--json", "-c", daemon.config_path)
    assert out.returncode == 0, out.stderr
    assert "poison attempt 4" in out.stdout
    daemon.assert_clean()


def test_retry_delays_are_jittered_and_capped_in_the_stored_run_at(tmp_path):
    """Jitter on (the default is 0.5): each retry's run_at, as the broker stores it, lies in
    [cap * (1 - jitter), cap] after the failed attempt ended, and the delays are not all equal."""
    d = Daemon(tmp_path, jobs={"backoff_base": 100.0, "backoff_cap": 30.0, "jitter": 0.5})
    try:
        d.start()
        ids = d.broker.enqueue_many([_new("poison", {}, max_attempts=2) for _ in range(8)])
        jobs = [d.wait_job(job_id, states=("retrying",)) for job_id in ids]
        delays = [j.run_at - j.history[-1]["ended_at"] for j in jobs]
        # run_at is now + delay at the write and ended_at is the broker's clock in the same
        # write: they differ by the delay plus at most the write's round trip.
        assert all(15.0 - 0.5 <= delay <= 30.0 + 0.5 for delay in delays), delays
        assert len({round(delay, 2) for delay in delays}) >= 2, delays
        assert all(j.attempt == 1 and j.history[-1]["outcome"] == "retry" for j in jobs)
        d.signal(signal.SIGTERM)
        assert d.wait_exit() == 0
        d.assert_clean()
    finally:
        d.stop()


def test_permanent_failure_is_dead_after_one_attempt(daemon):
    daemon.start()
    marker = daemon.marker("m")
    job_id = daemon.enqueue("permanent", {"marker": marker}, max_attempts=5)
    job = daemon.wait_job(job_id)
    assert (job.state, job.reason, job.attempt) == ("dead", "permanent", 1)
    assert read_lines(marker) == [["1"]]
    daemon.assert_clean()


def test_sigterm_lets_the_running_job_finish_and_exits_zero(daemon):
    daemon.start()
    marker, release = daemon.marker("m"), daemon.marker("release")
    job_id = daemon.enqueue("hold", {"marker": marker, "release": release})
    wait_for(lambda: read_lines(marker), message="job to start")
    daemon.signal(signal.SIGTERM)
    wait_for(lambda: daemon.status()["stopping"] == "graceful", message="graceful stop to begin")
    queued = daemon.enqueue("noop")  # due while stopping, with an idle child: must be left queued, untouched
    open(release, "w").close()
    assert daemon.wait_exit() == 0
    assert daemon.job(job_id).state == "done"
    left = daemon.job(queued)
    assert (left.state, left.attempt, left.history) == ("queued", 0, [])
    assert "graceful timeout passed" not in daemon.logs()  # it exited because the job ended
    daemon.assert_clean()


def test_master_sigkill_takes_children_down_and_another_supervisor_finishes(tmp_path):
    d = Daemon(tmp_path, broker={"lease_seconds": 2.0, "heartbeat_seconds": 0.5})
    try:
        d.start()
        marker, release = d.marker("m"), d.marker("release")
        job_id = d.enqueue("hold", {"marker": marker, "release": release, "max_wait": 60})
        wait_for(lambda: read_lines(marker), message="job to start")
        children = d.worker_pids()
        d.signal(signal.SIGKILL)
        d.wait_exit()
        wait_for(lambda: not any(_alive(p) for p in children), timeout=2.0,
                 message="children to exit after their master died")
        open(release, "w").close()
        d2 = Daemon(tmp_path / "second", broker_url=d.broker_url, broker={"lease_seconds": 2.0})
        try:
            d2.start()
            job = d2.wait_job(job_id, timeout=30)
            assert (job.state, job.attempt) == ("done", 2)
            assert job.history[0]["outcome"] == "lease_expired"
            d2.assert_clean()
        finally:
            d2.stop()
    finally:
        d.stop()


def test_sighup_applies_a_new_worker_count(daemon):
    daemon.start()
    before = daemon.status()
    daemon.config["supervisor"]["workers"] = 3
    daemon.write_config()
    daemon.signal(signal.SIGHUP)
    wait_for(lambda: _idle(daemon, generation=2) == 3, message="three children of generation 2")
    status = daemon.status()
    assert status["generation"] == before["generation"] + 1 and status["reload_error"] is None
    assert not set(w["pid"] for w in before["workers"]) & set(daemon.worker_pids())
    assert daemon.wait_job(daemon.enqueue("noop")).state == "done"
    daemon.assert_clean()


def test_sighup_applies_a_new_log_format(daemon):
    """log.format changed by a reload was kept as it was without a word (the reload said it re-read
    the config): a switch to text for a look at the journal, or back to JSON, needed a restart."""
    daemon.start()
    daemon.config["log"]["format"] = "text"
    daemon.write_config()
    daemon.signal(signal.SIGHUP)
    wait_for(lambda: daemon.status()["generation"] == 2, message="generation 2")
    wait_for(lambda: "reloaded: generation 2" in daemon.logs(), message="the reload's log line")
    line = next(line for line in daemon.logs().splitlines() if "reloaded: generation 2" in line)
    assert not line.startswith("{") and " INFO " in line, line
    daemon.config["log"]["format"] = "json"
    daemon.write_config()
    daemon.signal(signal.SIGHUP)
    wait_for(lambda: daemon.records(event="reload", generation=3), message="generation 3's reload logged as JSON")
    daemon.assert_clean()


@pytest.mark.parametrize("breakage", ["config", "handler", "huge_number", "bad_mark", "socket", "huge_error", "empty",
                                      "exits_at_import", "waits_at_import"])
def test_sighup_with_a_broken_config_or_handler_keeps_serving(daemon, breakage):
    """A reload that cannot be applied keeps the running generation and says why. "huge_number"
    (a 400-digit integer: OverflowError in the check) and "bad_mark" (an error that is not
    Tangguh's, out of the registry) used to end the master itself; a new socket path was
    applied to nothing, and a second daemon with that config would start beside this one."""
    daemon.start()
    pids = sorted(daemon.worker_pids())
    if breakage == "config":
        with open(daemon.config_path, "a") as f:
            f.write("\n[broker]\nlease_seconds = 'soon'\n")
    elif breakage == "handler":
        with open(os.path.join(daemon.handlers, "broken.py"), "w") as f:
            f.write("import supervisor\n\ndef oops(:\n")
    elif breakage == "huge_error":  # 20 MB in every status reply and log line, before
        with open(os.path.join(daemon.handlers, "loud.py"), "w") as f:
            f.write("raise ValueError('x' * 20_000_000)\n")
    elif breakage in ("exits_at_import", "waits_at_import"):  # ended, or froze, the master itself
        daemon.config["supervisor"]["import_timeout"] = 1.0
        daemon.write_config()
        with open(os.path.join(daemon.handlers, "rude.py"), "w") as f:
            f.write("import os\nos._exit(7)\n" if breakage == "exits_at_import" else "import time\ntime.sleep(3600)\n")
    elif breakage == "empty":  # a deploy caught halfway: every job would be dead-lettered unknown_type
        for name in os.listdir(daemon.handlers):
            os.remove(os.path.join(daemon.handlers, name))
    elif breakage == "bad_mark":
        with open(os.path.join(daemon.handlers, "odd.py"), "w") as f:
            f.write("def odd(ctx, payload):\n    pass\n\nodd.__tangguh_job__ = {'not_a_setting': 1}\n")
    else:
        key = ("broker", "lease_seconds", 10**400) if breakage == "huge_number" else (
            "supervisor", "socket", daemon.socket + ".new")
        daemon.config[key[0]][key[1]] = key[2]
        daemon.write_config()
    daemon.signal(signal.SIGHUP)
    wait_for(lambda: daemon.status()["reload_error"], message="reload_error to be reported")
    status = daemon.status()
    assert status["generation"] == 1 and sorted(daemon.worker_pids()) == pids
    assert {"handler": "broken.py:3", "huge_number": "broker.lease_seconds: expected a positive number",
            "bad_mark": "odd.py", "socket": "supervisor.socket: changing it needs a restart",
            "config": "", "huge_error": "loud.py:1: ValueError: xxx",
            "empty": "holds no job handler now",
            "exits_at_import": "rude.py: the module ended the process importing it (exit code 7)",
            "waits_at_import": "rude.py: importing it took over 1s"}[breakage] in status["reload_error"]
    assert len(status["reload_error"]) < 3000 and len(daemon.logs()) < 100_000
    assert daemon.wait_job(daemon.enqueue("noop")).state == "done"
    daemon.assert_clean()


def test_a_reload_refused_for_redis_wait_replicas_names_that_key(tmp_path, redis_url):
    """broker.redis_wait_replicas is carried in the broker URL: a reload that changed it was refused
    as "broker.url: changing it needs a restart", naming a key the operator had not touched."""
    d = Daemon(tmp_path, broker_url=redis_url)
    try:
        d.start()
        d.config["broker"]["redis_wait_replicas"] = 1
        d.write_config()
        d.signal(signal.SIGHUP)
        wait_for(lambda: d.status()["reload_error"], message="the reload refused")
        status = d.status()
        assert status["reload_error"] == "broker.redis_wait_replicas: changing it needs a restart, not a reload"
        assert status["generation"] == 1
        d.assert_clean()
    finally:
        d.stop()


@pytest.mark.parametrize("kind", ["def", "async def"])
def test_a_new_handler_file_runs_after_sighup(daemon, kind):
    """A plain or an async handler. asyncio (2 MiB with its C module) is loaded by the
    registry with the first async handler, in the master before the fork, so the children
    share it; a daemon of plain functions never loads it."""
    daemon.start()
    job_id = daemon.enqueue("brand_new", {"x": 2}, max_attempts=1, delay=60)
    assert not _mapped(daemon.proc.pid, "_asyncio")
    with open(os.path.join(daemon.handlers, "fresh.py"), "w") as f:
        f.write(f"import supervisor\n\n@supervisor.job('brand_new')\n{kind} brand_new(ctx, payload):\n"
                "    return {'double': payload['x'] * 2}\n")
    daemon.signal(signal.SIGHUP)
    wait_for(lambda: "brand_new" in daemon.status()["handlers"] and _idle(daemon, generation=2) == 2,
             message="the new generation with the new handler")
    assert _mapped(daemon.proc.pid, "_asyncio") == (kind == "async def")
    job_id = daemon.enqueue("brand_new", {"x": 21}, max_attempts=1)
    job = daemon.wait_job(job_id)
    assert (job.state, job.result) == ("done", {"double": 42})
    daemon.assert_clean()


def test_a_reload_lets_go_of_the_previous_generations_handler_modules(daemon):
    """Each reload imports the handler files afresh, as modules of a new generation. The old
    generation's modules stayed in the master's ``sys.modules`` for ever, with everything
    they built at import: a deploy-and-reload a day grew the master by their size each
    time. A module's witness object reports when the module is freed."""
    freed = os.path.join(daemon.dir, "freed")
    with open(os.path.join(daemon.handlers, "witnessed.py"), "w") as f:
        f.write("import logging\nimport os\n\nimport supervisor\n\nclass _Witness:\n    def __del__(self):\n"
                "        logging.getLogger('tangguh.witness').warning('freed %s', __name__, extra={'event': 'freed'})\n"
                f"        with open({freed!r}, 'a') as f:\n            f.write(__name__ + '\\n')\n\n"
                "witness = _Witness()\nlog = logging.getLogger(__name__)\n\n"
                "@supervisor.job('loggers')\ndef loggers(ctx, payload):\n"
                "    return sorted(n for n in logging.Logger.manager.loggerDict if n.startswith('tangguh_handlers.'))\n")
    daemon.start()
    for generation in (2, 3, 4):
        daemon.signal(signal.SIGHUP)
        wait_for(lambda: daemon.status()["generation"] == generation, message=f"generation {generation}")

    def freed_modules():
        return open(freed).read().split() if os.path.exists(freed) else []

    wait_for(lambda: {"tangguh_handlers.g1.witnessed", "tangguh_handlers.g2.witnessed",
                      "tangguh_handlers.g3.witnessed"} <= set(freed_modules()), message="the old generations freed")
    assert "tangguh_handlers.g4.witnessed" not in freed_modules()  # the one in use stays
    # Freed by the reload that replaced them, not by some later collection (hours on an idle master).
    order = [r["msg"][6:] if r["event"] == "freed" else r["generation"] for r in daemon.records() if r.get("event") in ("freed", "reload")]
    assert order == ["tangguh_handlers.g1.witnessed", 2, "tangguh_handlers.g2.witnessed", 3,
                     "tangguh_handlers.g3.witnessed", 4], order
    # Nor their loggers (getLogger(__name__)): a child forked now sees the master's.
    assert daemon.wait_job(daemon.enqueue("loggers")).result == ["tangguh_handlers.g4",
                                                                 "tangguh_handlers.g4.witnessed"]
    assert daemon.wait_job(daemon.enqueue("noop")).state == "done"
    daemon.assert_clean()


def test_a_handler_module_that_forks_at_import_leaves_one_master(daemon):
    """The forked copy returned from the import into the master's reload and ran on as a
    second master, on the same self-pipe, socket and broker: it took signals meant for the
    master and answered for it. It leaves at once now."""
    daemon.start()
    with open(os.path.join(daemon.handlers, "forker.py"), "w") as f:
        f.write("import os\n\nos.fork()  # a library starting a helper that forgot os._exit\n")
    for generation in (2, 3, 4):
        daemon.signal(signal.SIGHUP)
        wait_for(lambda: daemon.status()["generation"] == generation, message=f"generation {generation}")
    reloads = daemon.records(event="reload")
    assert [(r["process"], r["generation"]) for r in reloads] == [(daemon.proc.pid, g) for g in (2, 3, 4)]
    assert daemon.wait_job(daemon.enqueue("noop")).state == "done"
    # Not assert_clean: the module's own fork, beside the heartbeat thread, gets Python 3.12+'s
    # fork warning, and that fork is what this test is about. Nothing is left leased:
    assert all(s.in_flight == 0 for s in daemon.broker.stats(["default"]).values())


def _a_module_that_waits_at_import(daemon):
    """(slow, importing, release): while ``slow`` exists, importing the module marks
    ``importing`` and waits (up to 60 s) for ``release``; the import timeout is longer."""
    slow, importing, release = (os.path.join(daemon.dir, name) for name in ("slow", "importing", "release"))
    with open(os.path.join(daemon.handlers, "waits.py"), "w") as f:
        f.write(f"import os, time\n\nif os.path.exists({slow!r}):\n    open({importing!r}, 'a').close()\n"
                f"    deadline = time.monotonic() + 60\n"
                f"    while not os.path.exists({release!r}) and time.monotonic() < deadline:\n"
                "        time.sleep(0.01)\n")
    daemon.config["supervisor"]["import_timeout"] = 120.0
    daemon.write_config()
    return slow, importing, release


def test_a_stop_signal_during_a_reloads_trial_import_is_not_kept_waiting(daemon):
    """The trial import held the master's loop until it ended: a SIGTERM waited for it (and
    then for the master's own import)."""
    slow, importing, _ = _a_module_that_waits_at_import(daemon)
    daemon.start()
    open(slow, "w").close()
    daemon.signal(signal.SIGHUP)
    wait_for(lambda: os.path.exists(importing), message="the trial import under way")
    daemon.signal(signal.SIGTERM)
    assert daemon.proc.wait(timeout=20) == 0
    [failed] = daemon.records(event="reload_failed")
    assert "the reload gave way to a stop signal" in failed["msg"]


def test_the_loop_serves_on_while_a_reloads_trial_import_waits_and_hups_meanwhile_make_one_reload(daemon):
    """The trial import held the master's loop until it ended (up to import_timeout): no job
    ran, no hard timeout fired, status did not answer; and each SIGHUP sent meanwhile made a
    reload of its own, one after another. A SIGTTIN sent meanwhile counts once the reloads are
    over (acted on at once, the new generation's worker count undid it)."""
    slow, importing, release = _a_module_that_waits_at_import(daemon)
    daemon.start()
    open(slow, "w").close()
    daemon.signal(signal.SIGHUP)
    wait_for(lambda: os.path.exists(importing), message="the trial import under way")
    daemon.signal(signal.SIGHUP)
    daemon.signal(signal.SIGHUP)
    daemon.signal(signal.SIGTTIN)
    assert daemon.wait_job(daemon.enqueue("noop"), timeout=20).state == "done"  # served while it imports
    assert daemon.status()["generation"] == 1
    os.remove(slow)
    open(release, "w").close()
    wait_for(lambda: daemon.status()["generation"] == 3, timeout=20, message="the reload, then one more")
    assert [r["generation"] for r in daemon.records(event="reload")] == [2, 3]
    assert daemon.status()["reload_error"] is None
    wait_for(lambda: daemon.status()["target_workers"] == 3 and _idle(daemon, generation=3) == 3,
             message="the SIGTTIN, after the reloads")
    daemon.assert_clean()


@pytest.mark.parametrize("module, verdict", [("x = 1\n", ""), ("import os\nos._exit(3)\n", "exit code 3")])
def test_a_trial_the_masters_reaping_of_any_child_took_first_still_gives_its_verdict(tmp_path, module, verdict):
    """The pool reaps every child the master has (waitpid(-1)), the reload's trial process too
    when it ends between the loop's look at the trial and the pool's turn: the trial's own
    waitpid then raised ChildProcessError, which ended the master ("No child processes")."""
    from supervisor.master import trial as trial_module

    (tmp_path / "handlers").mkdir()
    (tmp_path / "handlers" / "m.py").write_text(module)
    tried = trial_module.Trial(str(tmp_path / "handlers"), 2, None, 30.0)
    pool = Pool(SimpleNamespace(workers=1), *[None] * 8)
    pool.others[tried.leader] = tried.exited
    try:
        wait_for(lambda: psutil.Process(tried.leader).status() == psutil.STATUS_ZOMBIE, message="the trial's end")
        pool.reap()  # before the trial looks: its status goes to the trial
        problem = tried.poll()
        assert problem is not None and verdict in problem and (problem == "") == (verdict == "")
    finally:
        tried.close()
    assert not pool.others


def test_a_helper_process_a_module_forks_at_import_neither_fails_the_reload_nor_outlives_the_trial(daemon):
    """The trial waited for its pipe's end, which a forked helper held: every reload timed
    out, and the trial's helper was left running. The helper here is a grandchild (a library
    that daemonises: its first fork leaves at once), so the trial's end of its own children does
    not reach it: only its process group's kill does, and it holds the trial's pipe."""
    helpers = os.path.join(daemon.dir, "helpers")
    with open(os.path.join(daemon.handlers, "helper.py"), "w") as f:
        # The first fork writes the helper's line (its parent: the importing process) and leaves
        # before the import ends: a helper killed with the trial before it ran would write none.
        f.write(f"import os, time\n\nfirst = os.fork()\nif first == 0:\n    helper = os.fork()\n"
                f"    if helper == 0:\n        time.sleep(60)\n        os._exit(0)\n"
                f"    with open({helpers!r}, 'a') as f:\n        f.write(f'{{helper}} {{os.getppid()}}\\n')\n"
                f"    os._exit(0)\nos.waitpid(first, 0)\n")
    daemon.config["supervisor"]["import_timeout"] = 30.0
    daemon.write_config()
    daemon.start()
    daemon.signal(signal.SIGHUP)
    wait_for(lambda: daemon.status()["generation"] == 2, timeout=20, message="the reload, well before the timeout")
    assert daemon.status()["reload_error"] is None

    def trial_helpers_alive():
        return [int(pid) for pid, parent in read_lines(helpers) if int(parent) != daemon.proc.pid and psutil.pid_exists(int(pid))
                and psutil.Process(int(pid)).status() != psutil.STATUS_ZOMBIE]
    wait_for(lambda: len(read_lines(helpers)) == 4, message="a helper from each trial and each import")
    wait_for(lambda: not trial_helpers_alive(), message="the trials' helpers gone with them")
    for pid, parent in read_lines(helpers):
        if int(parent) == daemon.proc.pid and psutil.pid_exists(int(pid)):
            os.kill(int(pid), signal.SIGKILL)  # the master's own: the module's business, not the test's


def test_a_helper_a_module_starts_in_a_session_of_its_own_does_not_outlive_the_trial(daemon):
    """The trial ends what its import started by killing its process group: a helper started in a
    session of its own (``subprocess.Popen(..., start_new_session=True)``, a sidecar server) left
    that group and ran on, one more at every start and every reload. The trial ends its own
    children before it leaves."""
    helpers = os.path.join(daemon.dir, "helpers")
    with open(os.path.join(daemon.handlers, "sidecar.py"), "w") as f:
        f.write(f"import os, subprocess\n\nhelper = subprocess.Popen(['sleep', '60'], start_new_session=True).pid\n"
                f"with open({helpers!r}, 'a') as f:\n    f.write(f'{{helper}} {{os.getpid()}}\\n')\n")
    daemon.start()

    def trial_helpers_alive():
        return [int(pid) for pid, parent in read_lines(helpers) if int(parent) != daemon.proc.pid
                and psutil.pid_exists(int(pid)) and psutil.Process(int(pid)).status() != psutil.STATUS_ZOMBIE]
    try:
        assert len(read_lines(helpers)) == 2  # the trial's, the master's
        wait_for(lambda: not trial_helpers_alive(), message="the trial's helper gone with it")
    finally:
        for pid, _ in read_lines(helpers):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


@pytest.mark.parametrize("end", ["import_timeout", "stop"])
def test_a_helper_in_a_session_of_its_own_ends_with_a_trial_that_never_finished_its_import(daemon, end):
    """The trial's own children were ended only when its import finished: a trial that ran out of
    import_timeout, or that a stop signal ended, was killed with its process group, and a helper
    its module had started in a session of its own ran on, one more at every such reload."""
    helpers = os.path.join(daemon.dir, "helpers")
    daemon.config["supervisor"]["import_timeout"] = 2.0
    daemon.write_config()
    daemon.start()
    with open(os.path.join(daemon.handlers, "sidecar.py"), "w") as f:
        f.write(f"import subprocess, time\n\nhelper = subprocess.Popen(['sleep', '60'], start_new_session=True).pid\n"
                f"with open({helpers!r}, 'a') as f:\n    f.write(f'{{helper}}\\n')\ntime.sleep(3600)\n")

    def alive():
        return [int(pid) for (pid,) in read_lines(helpers) if psutil.pid_exists(int(pid))
                and psutil.Process(int(pid)).status() != psutil.STATUS_ZOMBIE]
    try:
        daemon.signal(signal.SIGHUP)
        wait_for(lambda: read_lines(helpers), message="the trial's helper started")
        if end == "stop":
            daemon.signal(signal.SIGTERM)
            assert daemon.proc.wait(timeout=20) == 0
        else:
            wait_for(lambda: daemon.records(event="reload_failed"), message="the trial out of time")
        wait_for(lambda: not alive(), message="the trial's helper gone with it")
    finally:
        for (pid,) in read_lines(helpers):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


def test_a_signal_sent_to_a_helper_a_module_forked_at_a_reload_is_not_the_masters(daemon):
    """The master imports a reload's modules after its signal handlers are in place: a helper
    forked there inherited them and the master's self-pipe, and a SIGTERM sent to that helper
    alone stopped the master (a SIGHUP reloaded it). The helper starts with a new process's
    signals now, and the SIGTERM ends it."""
    helpers = os.path.join(daemon.dir, "helpers")
    with open(os.path.join(daemon.handlers, "helper.py"), "w") as f:
        f.write(f"import os, time\n\nhelper = os.fork()\nif helper == 0:\n    time.sleep(60)\n    os._exit(0)\n"
                f"with open({helpers!r}, 'a') as f:\n    f.write(f'{{helper}} {{os.getpid()}}\\n')\n")
    daemon.start()
    daemon.signal(signal.SIGHUP)
    wait_for(lambda: daemon.status()["generation"] == 2, timeout=20, message="the reload")
    wait_for(lambda: len(read_lines(helpers)) == 4, message="a helper from each trial and each import")
    ours = [int(pid) for pid, parent in read_lines(helpers) if int(parent) == daemon.proc.pid]
    assert len(ours) == 2

    def ended(pid):
        return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    for pid in ours:
        os.kill(pid, signal.SIGTERM)
    try:
        wait_for(lambda: all(ended(pid) for pid in ours), message="the helpers ended by their SIGTERM")
    finally:
        for pid in ours:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert daemon.proc.poll() is None and daemon.status()["generation"] == 2
    assert daemon.wait_job(daemon.enqueue("noop")).state == "done"


def test_a_helper_a_module_forked_at_a_reload_does_not_hold_the_masters_listeners(daemon):
    """A reload's modules are imported by a master that has its socket and metrics port open: a
    helper forked there held both, so once the master was killed (the OOM killer, kill -9)
    a new ``tangguh run`` exited 3, "another supervisor is running", and status calls hung on
    a socket nobody answered. Every process the master forks closes its listeners at once."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    daemon.config["metrics"] = {"listen": f"127.0.0.1:{port}"}
    daemon.write_config()
    helpers = os.path.join(daemon.dir, "helpers")
    with open(os.path.join(daemon.handlers, "helper.py"), "w") as f:
        f.write(f"import os, time\n\nhelper = os.fork()\nif helper == 0:\n    time.sleep(120)\n    os._exit(0)\n"
                f"with open({helpers!r}, 'a') as f:\n    f.write(f'{{helper}} {{os.getpid()}}\\n')\n")
    daemon.start()
    try:
        daemon.signal(signal.SIGHUP)
        wait_for(lambda: daemon.status()["generation"] == 2, timeout=20, message="the reload")
        wait_for(lambda: len(read_lines(helpers)) == 4, message="a helper from each trial and each import")
        first = daemon.proc.pid
        os.kill(first, signal.SIGKILL)
        daemon.proc.wait(10)
        daemon.start()  # waits for a status answer: it exited 3 before
        assert daemon.status()["pid"] not in (first, None)
        assert daemon.wait_job(daemon.enqueue("noop")).state == "done"
        with socket.create_connection(("127.0.0.1", port), timeout=5) as http:
            http.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            assert b" 200 " in http.recv(64).split(b"\r\n")[0]  # the new master's endpoint
        assert not daemon.records(event="metrics_failed")
    finally:
        for pid, _ in read_lines(helpers):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


def test_a_reload_that_drops_job_types_names_them(daemon):
    with open(os.path.join(daemon.handlers, "extra.py"), "w") as f:
        f.write("import supervisor\n\n@supervisor.job('extra')\ndef extra(ctx, payload):\n    pass\n")
    daemon.start()
    os.remove(os.path.join(daemon.handlers, "extra.py"))
    daemon.signal(signal.SIGHUP)
    wait_for(lambda: daemon.status()["generation"] == 2, message="generation 2")
    [record] = daemon.records(event="reload")
    assert (record["level"], record["dropped_types"]) == ("warning", ["extra"])
    assert "no longer serves extra (their jobs claimed here are dead-lettered: unknown_type)" in record["msg"]


@pytest.mark.parametrize("sig", [signal.SIGTTIN, signal.SIGTTOU])
def test_a_worker_signal_sent_to_every_process_during_the_trial_import_does_not_stop_the_trial(daemon, sig):
    """``systemctl kill -s TTIN`` signals every process of the service, the trial import's too. It
    left it SIGTTIN's default action, which stops a process in a group that is not orphaned (the
    trial's own, beside the master's): stopped, it ran out of ``import_timeout`` and the start
    failed with exit 2, "a module waiting at import?" (a reload likewise). The trial catches the
    master's worker signals as it catches SIGHUP; the master applies them once up."""
    daemon.config["supervisor"]["import_timeout"] = 20
    daemon.write_config()
    importing = os.path.join(daemon.dir, "importing")
    with open(os.path.join(daemon.handlers, "slow.py"), "w") as f:
        f.write(f"import os, time\n\nopen({importing!r}, 'a').write(f'{{os.getpid()}}\\n')\ntime.sleep(1.5)\n")
    daemon.start(wait=False)
    wait_for(lambda: os.path.exists(importing), message="the trial to import")
    trial_pid = int(read_lines(importing)[0][0])
    assert trial_pid != daemon.proc.pid
    for pid in (daemon.proc.pid, trial_pid):  # every process of the service, as systemctl kill does
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    wait_for(daemon.ready, timeout=15, message="the daemon up, its trial not stopped")
    assert daemon.status()["target_workers"] == (3 if sig == signal.SIGTTIN else 1)
    daemon.assert_clean()


def test_a_sighup_while_the_handlers_import_at_start_is_a_reload_afterwards(daemon):
    """Before its signal handlers were set, a SIGHUP (logrotate, a deploy script) ended the
    daemon at start-up: for systemd a clean exit, so no restart either."""
    importing, helper = os.path.join(daemon.dir, "importing"), os.path.join(daemon.dir, "helper")
    with open(os.path.join(daemon.handlers, "slow.py"), "w") as f:
        f.write(f"import os, subprocess, time\n\nhelper = subprocess.Popen(['sleep', '60']).pid  # a helper program\n"
                f"with open({helper!r}, 'a') as f:\n    f.write(f'{{helper}} {{os.getpid()}}\\n')\n"
                f"open({importing!r}, 'a').close()\ntime.sleep(1.5)\n")
    daemon.start(wait=False)
    wait_for(lambda: os.path.exists(importing), message="the handlers to import")
    daemon.signal(signal.SIGHUP)
    wait_for(daemon.ready, timeout=30, message="the daemon up despite the SIGHUP")
    wait_for(lambda: daemon.status()["generation"] == 2, message="the SIGHUP applied as a reload")
    assert daemon.wait_job(daemon.enqueue("noop")).state == "done"
    # The program a module started at the master's import has every signal as a program should:
    # none blocked. (The trial's went with the trial.)
    started = [(int(pid), int(parent)) for pid, parent in read_lines(helper)]
    pid = next(pid for pid, parent in started if parent == daemon.proc.pid)  # its start-up import's
    try:
        with open(f"/proc/{pid}/status") as f:
            masks = dict(line.split(":\t") for line in f if line.startswith(("SigBlk", "SigIgn")))
    finally:
        for other, _ in started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(other, signal.SIGKILL)
    assert int(masks["SigBlk"], 16) == 0 and int(masks["SigIgn"], 16) & 1 == 0, masks
    daemon.assert_clean()


def test_a_sighup_to_the_whole_group_reloads_without_ending_running_jobs(daemon):
    """``systemctl kill -s HUP`` (every process of the unit) or a hangup: the children took
    its default action and died mid-job, each job spending an attempt."""
    with open(os.path.join(daemon.handlers, "spawner.py"), "w") as f:
        f.write("import subprocess\n\nimport supervisor\n\n@supervisor.job('spawn')\ndef spawn(ctx, payload):\n"
                "    p = subprocess.Popen(['sleep', '60'])\n"
                "    masks = dict(l.split(':\\t') for l in open(f'/proc/{p.pid}/status') if l.startswith('SigIgn'))\n"
                "    p.kill()\n    p.wait()\n    return int(masks['SigIgn'], 16)\n")
    daemon.start()
    # Caught in the children, not ignored: a program a job starts would inherit an ignored one.
    assert daemon.wait_job(daemon.enqueue("spawn")).result & 0b11 == 0  # SIGHUP, SIGINT
    release, marker = os.path.join(daemon.dir, "release"), daemon.marker("naps")
    jobs = [daemon.enqueue("nap", {"seconds": 30, "release": release, "marker": marker}) for _ in range(2)]
    wait_for(lambda: len(read_lines(marker)) == 2, message="both jobs running")
    daemon.signal_every_process(signal.SIGHUP)
    wait_for(lambda: daemon.status()["generation"] == 2, message="the reload")
    open(release, "w").close()
    for job_id in jobs:
        job = daemon.wait_job(job_id)
        assert (job.state, job.attempt) == ("done", 1), job.history
    assert not daemon.records(event="crash")
    daemon.assert_clean()


def test_a_storm_of_group_sighups_ends_no_child_not_even_one_still_starting(tmp_path):
    """Every process the master forks starts with signals of its own, not the master's; with
    SIGHUP back at its default action there, a group SIGHUP that came between a child's fork and
    its own handlers killed it: 619 children in 20 s of a storm, boot failures, reloads failed."""
    import threading

    d = Daemon(tmp_path, supervisor={"workers": 6})
    storming = threading.Event()

    def storm():
        while not storming.wait(0.005):  # paced, not waited on: a hangup every 5 ms
            d.signal_every_process(signal.SIGHUP)
    thread = threading.Thread(target=storm)
    try:
        d.start()
        thread.start()
        wait_for(lambda: d.status()["generation"] >= 40, timeout=60, message="forty reloads in the storm")
        storming.set()
        thread.join()
        wait_for(lambda: len([w for w in d.status()["workers"] if w["state"] == "idle"]) == 6, timeout=30,
                 message="the last generation's children up")
        killed = [r for r in d.records() if r.get("signal") in (signal.SIGHUP, signal.SIGINT)]
        assert killed == [] and not d.records(event="boot_failure") and not d.records(event="reload_failed")
        assert d.wait_job(d.enqueue("noop")).state == "done"
    finally:
        storming.set()
        if thread.is_alive():
            thread.join()
        d.stop()


def _mapped(pid, library):
    """Whether a shared library whose file name contains ``library`` is mapped into ``pid``."""
    with open(f"/proc/{pid}/maps") as f:
        return any(library in os.path.basename(line.split()[-1]) for line in f if "/" in line)


def test_ttin_and_ttou_change_the_worker_count(daemon):
    daemon.start()
    daemon.signal(signal.SIGTTIN)
    wait_for(lambda: _idle(daemon) == 3, message="a third child")
    # Two identical signals sent back to back may reach the process as one
    # (the kernel keeps one pending bit per signal), so wait between them.
    daemon.signal(signal.SIGTTOU)
    wait_for(lambda: len(daemon.worker_pids()) == 2, message="two children left")
    daemon.signal(signal.SIGTTOU)
    wait_for(lambda: len(daemon.worker_pids()) == 1, message="one child left")
    assert daemon.status()["target_workers"] == 1
    # At the floor a SIGTTOU changes nothing, and the log must not claim it "lowered" the count.
    daemon.signal(signal.SIGTTOU)
    wait_for(lambda: len(daemon.records(event="ttou")) == 3, message="the third SIGTTOU's record")
    assert [r["msg"] for r in daemon.records(event="ttou")] == [
        "worker count lowered to 2", "worker count lowered to 1", "worker count stays at 1, the least (SIGTTOU ignored)"]
    assert daemon.status()["target_workers"] == 1
    assert daemon.wait_job(daemon.enqueue("noop")).state == "done"
    daemon.assert_clean()


def test_forks_the_system_refuses_leave_the_master_serving_with_the_children_it_has(daemon):
    """SIGTTIN past the file-descriptor limit (``LimitNOFILE=``, ``ulimit -n``): the failed
    socketpair ended the master, running jobs and all, and even before that a master with
    no descriptor left could not answer ``status`` nor reach its broker. Now the master
    keeps a reserve, serves on with the children it has, and forks again later."""
    daemon.start()
    master = psutil.Process(daemon.proc.pid)
    limit = master.num_fds() + childlimits.DESCRIPTOR_RESERVE + 3  # room for a few children more
    soft, hard = master.rlimit(psutil.RLIMIT_NOFILE)
    master.rlimit(psutil.RLIMIT_NOFILE, (limit, hard))
    for n in range(3, 11):  # one at a time: two identical pending signals may arrive as one
        daemon.signal(signal.SIGTTIN)
        wait_for(lambda: daemon.status()["target_workers"] == n, message=f"target {n}")
    wait_for(lambda: daemon.records(event="spawn_failed"), message="a fork refused for want of descriptors")
    status = daemon.status()
    assert 2 <= len(status["workers"]) < 10 and status["target_workers"] == 10
    assert daemon.wait_job(daemon.enqueue("noop")).state == "done"
    failures = re.search(r"^tangguh_spawn_failures_total (\S+)$", tangguh("metrics", "-c", daemon.config_path).stdout,
                         re.M)
    assert failures and float(failures.group(1)) >= 1
    master.rlimit(psutil.RLIMIT_NOFILE, (soft, hard))
    wait_for(lambda: len(daemon.status()["workers"]) == 10, timeout=60, message="the missing children, forked later")

    # A child that exits frees what it held: its replacement is forked then, not when the backoff ends.
    def last_backoff():
        record = daemon.records(event="spawn_failed")[-1]
        return float(re.search(r"next try in ([\d.]+)s", record["msg"]).group(1)), record["ts"]
    steady = min(master.num_fds() for _ in range(5))  # not a status client's connection
    master.rlimit(psutil.RLIMIT_NOFILE, (steady + childlimits.DESCRIPTOR_RESERVE - 2, hard))  # no room for a fork
    daemon.signal(signal.SIGTTIN)  # an eleventh: refused, again and again
    wait_for(lambda: last_backoff()[0] >= 6, timeout=60, message="forks refused long enough for a 6 s backoff")
    delay, failed_at = last_backoff()
    before = daemon.worker_pids()
    for pid in before[2:]:  # their descriptors are room for a fork again, whatever else comes and goes
        os.kill(pid, signal.SIGKILL)
    wait_for(lambda: set(daemon.worker_pids()) - set(before), timeout=failed_at + delay - time.time() - 1,
             message="a replacement, forked before the backoff ends")
    master.rlimit(psutil.RLIMIT_NOFILE, (soft, hard))
    daemon.assert_clean()


def test_the_worker_count_has_a_ceiling(daemon):
    """A count past the ceiling is a typo: the config refuses it, SIGTTIN stops there."""
    daemon.config["supervisor"]["workers"] = MAX_WORKERS + 1
    daemon.write_config()
    out = tangguh("config", "check", "-c", daemon.config_path)
    assert out.returncode != 0 and f"supervisor.workers: expected an integer from 1 to {MAX_WORKERS}" in out.stderr
    pool = Pool(SimpleNamespace(workers=MAX_WORKERS - 1), *[None] * 8)
    assert [pool.resize(+1), pool.resize(+1), pool.resize(-1)] == [MAX_WORKERS, MAX_WORKERS, MAX_WORKERS - 1]
    pool.target = 1
    assert pool.resize(-1) == 1


def test_garbage_on_the_health_socket_gets_an_error_and_harms_nothing(daemon):
    daemon.start()
    replies = []
    for line in (b"not json\n", b"[1,2]\n", b'{"cmd": "explode"}\n', b"x" * (70 * 1024)):
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(10)
        s.connect(daemon.socket)
        s.sendall(line)
        replies.append(json.loads(s.makefile().readline()))
        s.close()
    assert all(r["ok"] is False and r["error"] for r in replies), replies
    assert "unknown command" in replies[2]["error"]
    silent = socket.socket(socket.AF_UNIX)
    silent.connect(daemon.socket)  # says nothing: must not block anyone else
    assert daemon.status()["ok"] is True
    silent.settimeout(10)
    assert "timed out" in json.loads(silent.makefile().readline())["error"]
    silent.close()
    assert daemon.wait_job(daemon.enqueue("noop")).state == "done"
    daemon.assert_clean()


def test_many_rapid_child_crashes_never_hang_the_master(tmp_path):
    """The fork-safety test: 500 forks while the heartbeat thread renews leases busily."""
    d = Daemon(tmp_path, broker={"heartbeat_seconds": 0.01, "lease_seconds": 5.0, "prefetch": 4})
    try:
        d.start()
        total = 500
        d.broker.enqueue_many([_new("suicide", {"crashes": 5}, max_attempts=1) for _ in range(total)])
        wait_for(lambda: d.broker.stats(["default"])["default"].dead == total, timeout=240,
                 message="all crashing jobs dead-lettered")
        status = d.status()
        assert status["restarts"] == total and status["counters"]["crashed"] == total
        assert all(j.reason == "crashed" for j in d.broker.dlq_list(limit=None))
        assert d.wait_job(d.enqueue("noop")).state == "done"
        d.signal(signal.SIGTERM)
        assert d.wait_exit() == 0
        d.assert_clean()
    finally:
        d.stop()


def test_sigquit_stops_at_once_and_releases_the_running_job(daemon):
    daemon.start()
    marker, release = daemon.marker("m"), daemon.marker("release")
    job_id = daemon.enqueue("hold", {"marker": marker, "release": release, "max_wait": 60})
    wait_for(lambda: read_lines(marker), message="job to start")
    daemon.signal(signal.SIGQUIT)
    assert daemon.wait_exit() == 0
    job = daemon.job(job_id)
    assert (job.state, job.attempt) == ("queued", 0)
    daemon.assert_clean()


def test_a_sighup_during_a_graceful_stop_is_ignored_saying_so(daemon):
    """A HUP sent while the master finished its jobs before exiting was dropped without a word: an
    operator who reloaded then saw neither a reload nor a refusal in the log."""
    daemon.start()
    marker, release = daemon.marker("m"), daemon.marker("release")
    job_id = daemon.enqueue("hold", {"marker": marker, "release": release, "max_wait": 60})
    wait_for(lambda: read_lines(marker), message="job to start")
    daemon.signal(signal.SIGTERM)
    wait_for(lambda: daemon.records(event="stopping"), message="the graceful stop")
    daemon.signal(signal.SIGHUP)
    wait_for(lambda: daemon.records(event="reload_ignored"), message="the HUP said to be ignored")
    open(release, "w").close()
    assert daemon.wait_exit() == 0
    assert daemon.job(job_id).state == "done" and not daemon.records(event="reload")


def test_a_second_supervisor_on_the_same_socket_refuses_to_start(daemon, tmp_path):
    daemon.start()
    second = tangguh("run", "-c", daemon.config_path, timeout=30)
    assert second.returncode == 3
    assert "another supervisor" in second.stderr + second.stdout
    assert daemon.status()["ok"]
    daemon.assert_clean()


def test_a_second_supervisor_refuses_to_start_while_the_first_takes_no_connections(daemon):
    """A master whose loop is held up (here stopped) with its connection queue full is alive: the
    second one's probe got EAGAIN and it failed with "Resource temporarily unavailable", exit 1."""
    daemon.start()
    daemon.signal(signal.SIGSTOP)
    queued = []
    try:
        while True:  # fill its queue of connections: the next connect cannot wait, it fails
            s = socket.socket(socket.AF_UNIX)
            s.setblocking(False)
            queued.append(s)
            try:
                s.connect(daemon.socket)
            except BlockingIOError:
                break
        second = tangguh("run", "-c", daemon.config_path, timeout=30)
    finally:
        daemon.signal(signal.SIGCONT)
        for s in queued:
            s.close()
    assert second.returncode == 3, second.stderr + second.stdout
    assert "another supervisor is running" in second.stderr + second.stdout
    assert daemon.status()["ok"] and os.path.exists(daemon.socket)
    daemon.assert_clean()


def test_a_stale_socket_file_is_replaced(daemon):
    s = socket.socket(socket.AF_UNIX)
    s.bind(daemon.socket)
    s.close()  # a socket file nobody listens on: left over from a crash
    daemon.start()
    assert daemon.status()["ok"]
    assert oct(os.stat(daemon.socket).st_mode & 0o777) == oct(0o660)


def test_a_removed_socket_file_is_bound_again_and_a_stop_leaves_another_ones_socket(daemon):
    """Months of running: the socket file removed under the master comes back, so status finds it
    and a second supervisor still refuses; a path another socket took is never unlinked."""
    daemon.start()
    os.unlink(daemon.socket)
    wait_for(lambda: os.path.exists(daemon.socket), message="the removed socket file bound again")
    assert daemon.status()["ok"] and oct(os.stat(daemon.socket).st_mode & 0o777) == oct(0o660)
    assert daemon.records(event="socket_rebound")
    assert tangguh("run", "-c", daemon.config_path, timeout=30).returncode == 3  # not a second one beside it
    assert daemon.wait_job(daemon.enqueue("noop")).state == "done"

    other = socket.socket(socket.AF_UNIX)  # someone else's socket at the path now
    while True:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(daemon.socket)
        try:
            other.bind(daemon.socket)  # the master may have bound it again in between: once more
            break
        except OSError:
            continue
    other.listen(1)
    wait_for(lambda: daemon.records(event="socket_lost"), message="the master to see its path taken")
    daemon.signal(signal.SIGTERM)
    assert daemon.wait_exit() == 0
    assert os.path.exists(daemon.socket), "the stop unlinked another process's socket"
    probe = socket.socket(socket.AF_UNIX)
    probe.connect(daemon.socket)  # still the other one's, listening
    probe.close()
    other.close()
    daemon.assert_clean()


def test_a_handler_that_fails_to_import_is_a_startup_error(daemon):
    with open(os.path.join(daemon.handlers, "bad.py"), "w") as f:
        f.write("import supervisor\nx = 1\nraise RuntimeError('boom at import')\n")
    out = tangguh("run", "-c", daemon.config_path)
    assert out.returncode == 2
    assert "bad.py:3" in out.stderr and "boom at import" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("module, says", [
    ("import os\nos._exit(0)\n", "the module ended the process importing it (exit code 0)"),
    ("import time\ntime.sleep(600)\n", "importing it took over 2s"),
    ("import os, signal\nos.kill(os.getpid(), signal.SIGRTMIN + 6)\n",
     "the module ended the process importing it (signal SIGRTMIN+6)"),
])
def test_a_handler_module_that_exits_or_hangs_at_import_is_a_startup_error(tmp_path, module, says):
    """An ``os._exit(0)`` at import ended ``run`` with status 0 (systemd's Restart=on-failure
    took it for a clean stop and left the service down); a module waiting at import held the
    start for ever. The files are imported in a throwaway process first, as a reload does. The
    line names the file: among many, "a handler module" left the operator to guess which."""
    d = Daemon(tmp_path, supervisor={"import_timeout": 2})
    with open(os.path.join(d.handlers, "leaves.py"), "w") as f:
        f.write(module)
    with open(os.path.join(d.handlers, "zz_fine.py"), "w") as f:
        f.write("X = 1\n")  # imported after it, if ever: not the one named
    out = tangguh("run", "-c", d.config_path)
    assert out.returncode == 2, out
    named = os.path.join(d.handlers, "leaves.py")
    assert out.stderr.strip().splitlines() == [f"tangguh: error: supervisor.handlers: {named}: {says}"
                                               + ("" if "ended the process" in says else " (supervisor.import_timeout);"
                                                  " a module waiting at import?")]
    assert not os.path.exists(d.socket)  # it never served

def test_children_are_recycled_after_max_jobs(tmp_path):
    d = Daemon(tmp_path, supervisor={"workers": 1, "max_jobs_per_child": 3})
    try:
        d.start()
        marker = d.marker("m")
        ids = [d.enqueue("noop", {"marker": marker}) for _ in range(7)]
        for job_id in ids:
            d.wait_job(job_id)
        pids = [int(line[1]) for line in read_lines(marker)]
        assert len(set(pids[0:3])) == 1 and len(set(pids[3:6])) == 1 and pids[0] != pids[3] != pids[6]
        assert d.status()["restarts"] == 0  # recycling is not a crash
        metrics = tangguh("metrics", "-c", d.config_path).stdout
        assert 'tangguh_children_recycled_total{reason="max_jobs"} 2.0' in metrics.splitlines()
        assert "tangguh_children_restarted_total 0.0" in metrics.splitlines()
        wait_for(lambda: len(d.status()["workers"]) == 1, message="the recycled children to be gone")
        assert pids[6] in d.worker_pids()
        d.assert_clean()
    finally:
        d.stop()


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        import psutil

        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except Exception:  # noqa: BLE001
        return False


def _idle(d, generation=None):
    return sum(1 for w in d.status()["workers"]
               if w["state"] == "idle" and (generation is None or w["generation"] == generation))


def _new(type_, payload, **kw):
    from supervisor.model import NewJob

    return NewJob(type_, payload, **kw)


def test_a_sigterm_between_jobs_ends_the_child_quietly(daemon):
    """Found by the chaos soak: a hard-timeout SIGTERM can land just after the job
    ended (its reply already on the way). The idle child must leave without a
    JobTimeout traceback in the log; the master replaces it and jobs flow."""
    daemon.start()
    victim = daemon.worker_pids()[0]
    os.kill(victim, signal.SIGTERM)
    wait_for(lambda: victim not in daemon.worker_pids() and daemon.ready(), message="the child to be replaced")
    assert daemon.wait_job(daemon.enqueue("noop")).state == "done"
    assert daemon.status()["restarts"] == 1
    assert "Traceback" not in daemon.logs()
    daemon.signal(signal.SIGTERM)
    assert daemon.wait_exit() == 0
    daemon.assert_clean()


def test_a_handlers_follow_up_enqueue_goes_to_its_supervisors_broker(tmp_path, monkeypatch):
    # No client configured anywhere: the child's default is the supervisor's own config.
    monkeypatch.delenv("TANGGUH_CONFIG", raising=False)
    monkeypatch.delenv("TANGGUH_BROKER_URL", raising=False)
    d = Daemon(tmp_path)
    try:
        d.start()
        first = d.wait_job(d.enqueue("follow_up"))
        assert first.state == "done", first.error
        second = d.wait_job(first.result["next"])
        assert (second.type, second.state, second.payload) == ("noop", "done", {"after": first.id})
        d.assert_clean()
    finally:
        d.stop()


def test_signal_handlers_a_module_sets_at_a_reloads_import_do_not_replace_the_masters(daemon):
    """The master imports a reload's modules itself, after its signal handlers are set: a module
    that set its own there (SIGCHLD ignored, as some libraries do against zombies; SIGTERM at its
    default action) replaced the master's. Its children were never reaped again (a killed one
    never replaced, the retired generation listed for ever) and a SIGTERM ended the master at
    once, no graceful stop. At start-up the same module did no harm: the master's came after."""
    with open(os.path.join(daemon.handlers, "signals_at_import.py"), "w") as f:
        f.write("import signal\n\nsignal.signal(signal.SIGCHLD, signal.SIG_IGN)\n"
                "signal.signal(signal.SIGTERM, signal.SIG_DFL)\n")
    daemon.start()
    daemon.signal(signal.SIGHUP)
    wait_for(lambda: _idle(daemon, generation=2) == 2 and len(daemon.status()["workers"]) == 2,
             message="the new generation alone, the old one reaped")
    victim = daemon.worker_pids()[0]
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: victim not in daemon.worker_pids() and _idle(daemon, generation=2) == 2,
             message="the killed child reaped and replaced")
    assert daemon.wait_job(daemon.enqueue("noop")).state == "done"
    daemon.signal(signal.SIGTERM)
    assert daemon.proc.wait(timeout=20) == 0
    assert daemon.records(event="stopping")
    daemon.assert_clean()
