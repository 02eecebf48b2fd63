"""Every numeric config key has an upper bound: past it a wait, a time stamp or a broker's integer
column overflowed at run time (the heartbeat thread died on 1e299 s; a prefetch of 10**30 failed
every claim), while ``config check`` said ok. ``config check``, ``run`` and a reload refuse them."""
import signal
import subprocess
import sys

import pytest

from supervisor import cli
from supervisor.model import MAX_INT

from .daemon import Daemon
from .util import wait_for


@pytest.fixture
def daemon(tmp_path):
    d = Daemon(tmp_path)
    yield d
    d.stop()

DAY, HOUR, YEAR, TEN_YEARS = "86400 (a day)", "3600 (an hour)", "31536000 (a year)", "315360000 (ten years)"
SECONDS = [("supervisor.graceful_timeout", DAY), ("supervisor.kill_grace", DAY), ("supervisor.cancel_grace", DAY),
           ("supervisor.poll_interval", HOUR), ("supervisor.import_timeout", YEAR),
           ("broker.lease_seconds", DAY), ("broker.heartbeat_seconds", DAY), ("broker.retention", TEN_YEARS),
           ("jobs.timeout", YEAR), ("jobs.soft_timeout", YEAR), ("jobs.backoff_base", TEN_YEARS),
           ("jobs.backoff_cap", TEN_YEARS), ("jobs.jitter", "1"), ("jobs.types.mail.timeout", YEAR),
           ("jobs.types.mail.soft_timeout", YEAR), ("toolkit.idempotency_retention", TEN_YEARS)]
COUNTS = [("supervisor.workers", "1024"), ("supervisor.max_jobs_per_child", str(MAX_INT)),
          ("supervisor.max_child_rss_mb", str(MAX_INT)), ("supervisor.max_boot_failures", str(MAX_INT)),
          ("broker.prefetch", str(MAX_INT)), ("broker.redis_wait_replicas", str(MAX_INT)),
          ("jobs.max_attempts", str(MAX_INT)), ("jobs.types.mail.max_attempts", str(MAX_INT)),
          ("jobs.types.mail.max_concurrency", str(MAX_INT)), ("schedules.s.catch_up", "1000")]
HUGE = ["1e299", "inf", "-inf", "nan", "1e30", str(10**30), str(MAX_INT + 1)]
CASES = ([(key, bound, value) for key, bound in SECONDS for value in HUGE[:-1]]
         + [(key, bound, value) for key, bound in COUNTS for value in HUGE])


def write(tmp_path, key, value):
    table, _, name = key.rpartition(".")
    path = tmp_path / "tangguh.toml"
    path.write_text(f"[{table}]\n{name} = {value}\n")
    (tmp_path / "handlers").mkdir(exist_ok=True)
    return str(path)


@pytest.mark.parametrize("key,bound,value", CASES)
def test_config_check_refuses_a_value_past_the_bound_naming_key_bound_and_value(capsys, tmp_path, key, bound, value):
    code = cli.main(["config", "check", "-c", write(tmp_path, key, value)])
    out, err = capsys.readouterr()
    assert (code, out) == (2, "") and err.count("\n") == 1, err
    assert err.startswith(f"tangguh: error: {key}: expected ") and bound in err, err
    got = err.rsplit(", got ", 1)[1].strip()
    assert got == value == "nan" or float(got) == float(value), got


@pytest.mark.parametrize("key,bound", [(k, b) for k, b in SECONDS if "jitter" not in k])
def test_the_bound_itself_is_a_valid_value(capsys, tmp_path, key, bound):
    # lease_seconds must stay above heartbeat_seconds: at its bound, the heartbeat's default is below it
    value = bound.split()[0]
    if key == "broker.heartbeat_seconds":
        path = tmp_path / "tangguh.toml"
        path.write_text(f"[broker]\nlease_seconds = {value}\nheartbeat_seconds = {int(value) - 1}\n")
        (tmp_path / "handlers").mkdir()
        path = str(path)
    else:
        path = write(tmp_path, key, value)
    assert cli.main(["config", "check", "-c", path]) == 0, capsys.readouterr().err


def test_minus_zero_is_a_positive_keys_zero_and_refused(capsys, tmp_path):
    assert cli.main(["config", "check", "-c", write(tmp_path, "broker.lease_seconds", "-0.0")]) == 2
    assert capsys.readouterr().err.endswith(f"up to {DAY}, got -0.0\n")


def test_run_refuses_a_heartbeat_past_a_day_before_it_starts(tmp_path):
    path = tmp_path / "tangguh.toml"
    path.write_text(f'[supervisor]\nhandlers = "h"\n[broker]\nurl = "sqlite:///{tmp_path}/b.db"\n'
                    "lease_seconds = 1e300\nheartbeat_seconds = 1e299\n")
    (tmp_path / "h").mkdir()
    result = subprocess.run([sys.executable, "-m", "supervisor.cli", "run", "-c", str(path)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2 and not (tmp_path / "tangguh.sock").exists()
    assert result.stderr == ("tangguh: error: broker.lease_seconds: expected a positive number of seconds up to"
                             f" {DAY}, got 1e+300\n")


def test_a_reload_to_a_value_past_its_bound_is_refused_and_the_old_config_serves_on(daemon):
    """A SIGHUP to lease_seconds = 1e300 and heartbeat_seconds = 1e299 was taken: the heartbeat thread's
    wait overflowed and it died, so no lease was renewed again and every long job ran twice."""
    daemon.start()
    config = {**daemon.config, "broker": {**daemon.config["broker"], "lease_seconds": 1e300,
                                          "heartbeat_seconds": 1e299}}
    daemon.write_config(config)
    daemon.signal(signal.SIGHUP)
    [failed] = wait_for(lambda: daemon.records(event="reload_failed"), message="the reload refused")
    assert f"broker.lease_seconds: expected a positive number of seconds up to {DAY}, got 1e+300" in failed["msg"]
    status = daemon.status()
    assert status["generation"] == 1 and "broker.lease_seconds" in status["reload_error"]
    # Served on the old config: the heartbeat renews a held job's lease, and the job runs once.
    marker, release = daemon.marker("ran"), daemon.marker("release")
    job_id = daemon.enqueue("hold", {"marker": marker, "release": release, "max_wait": 60})
    first = wait_for(lambda: (j := daemon.job(job_id)).state == "running" and j.lease_until, message="job running")
    wait_for(lambda: daemon.job(job_id).lease_until > first, message="the held job's lease renewed")
    open(release, "w").close()
    assert daemon.wait_job(job_id).state == "done"
    with open(marker) as f:
        assert sum(line.startswith("started") for line in f) == 1
    daemon.signal(signal.SIGTERM)
    assert daemon.wait_exit() == 0
    daemon.assert_clean()


def test_an_integer_too_long_to_read_is_invalid_toml_not_an_internal_error(capsys, tmp_path):
    # Past Python's 4300 digits, tomllib raised a bare ValueError: "internal error", exit 1.
    path = write(tmp_path, "broker.prefetch", "9" * 5000)
    assert cli.main(["config", "check", "-c", path]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tangguh: error: {path}: invalid TOML: ") and "5000 digits" in err and err.count("\n") == 1
