"""The operator's side, as real processes: secrets kept out of every output, a config that
can never work refused at start, status while the config file is broken, the first run
of a new user, and the version.
"""
import json
import os
import platform
import signal
import subprocess
import sys
import uuid

import pytest
import tomli_w

import supervisor

from .daemon import Daemon, daemon_env, tangguh
from .util import url_with, wait_for

SECRET = "s3cret-Pw-42"


def _with(url, **params):
    return url + ("&" if "?" in url else "?") + "&".join(f"{k}={v}" for k, v in params.items())


# -- passwords never shown ------------------------------------------------------------

def test_postgres_password_never_shown_by_status_logs_migrate_or_a_failed_reload(tmp_path, postgres_url):
    # Trust authentication ignores passwords: the daemon runs with both forms in its URL.
    url = _with(postgres_url.replace("postgresql://postgres@", f"postgresql://postgres:{SECRET}@"),
                password=SECRET)
    d = Daemon(tmp_path, broker_url=url, log={"level": "debug", "format": "text"})
    try:
        d.start()
        outputs = [json.dumps(d.status())]
        for args in (["status"], ["status", "--json"], ["db", "migrate"]):
            result = tangguh(*args, "-c", d.config_path)
            assert result.returncode == 0, result.stderr
            outputs += [result.stdout, result.stderr]
        assert "postgres:***@" in json.dumps(d.status()) and "password=***" in json.dumps(d.status())
        # A mistyped scheme on reload: reload_error and the log name the scheme only.
        d.config["broker"]["url"] = url.replace("postgresql://", "postgressql://")
        d.write_config()
        d.signal(signal.SIGHUP)
        error = wait_for(lambda: d.status()["reload_error"], message="the reload to fail")
        assert "postgressql" in error
        result = tangguh("status", "-c", d.config_path)  # the broken config warns, status still answers
        outputs += [error, result.stdout, result.stderr, json.dumps(d.status())]
        d.signal(signal.SIGTERM)
        assert d.wait_exit() == 0
        outputs.append(d.logs())
        assert "reload failed" in d.logs()
        for text in outputs:
            assert SECRET not in text
    finally:
        d.stop()


def test_broker_down_log_and_status_hide_the_password(tmp_path):
    # Nothing listens on port 1: an outage (the daemon waits it out), logged once.
    url = f"redis://:{SECRET}@127.0.0.1:1/0?socket_connect_timeout=0.5"
    d = Daemon(tmp_path, broker_url=url)
    try:
        d.start()
        status = wait_for(lambda: (s := d.status())["broker_down"] and s, message="broker_down")
        assert SECRET not in json.dumps(status) and status["broker"].startswith("redis://:***@127.0.0.1:1/0")
        wait_for(lambda: '"broker_down"' in d.logs(), message="the broker_down log line")
        result = tangguh("status", "-c", d.config_path)
        assert result.returncode == 0 and "BROKER DOWN" in result.stdout
        assert SECRET not in d.logs() + result.stdout + result.stderr
    finally:
        d.stop()


# -- a broker URL that can never work: exit 2 at start ---------------------------------------

def _run_once(tmp_path, url, **supervisor_options):
    os.makedirs(tmp_path / "handlers", exist_ok=True)
    path = tmp_path / "tangguh.toml"
    with open(path, "wb") as f:
        tomli_w.dump({"supervisor": {"socket": str(tmp_path / "t.sock"), **supervisor_options},
                      "broker": {"url": url}, "log": {"format": "json"}}, f)
    result = subprocess.run([sys.executable, "-m", "supervisor.cli", "run", "-c", str(path)], capture_output=True,
                            text=True, timeout=60, env=daemon_env())
    return result, path


def _assert_refused(result, *words):
    assert result.returncode == 2, result.stdout + result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("tangguh: error: "), result.stderr
    for word in words:
        assert word in last, last
    assert SECRET not in result.stdout + result.stderr


@pytest.mark.parametrize("mangle, words", [
    (lambda u: _with(u, bogus_option=1, password=SECRET), ["unknown option(s) bogus_option"]),
    (lambda u: url_with(u, port=99999), ["invalid port number"]),
    # A libpq option with a value it refuses was an outage: BROKER DOWN for good, config check only warned.
    (lambda u: _with(u, target_session_attrs="bogus"), ['invalid target_session_attrs value: "bogus"']),
    (lambda u: url_with(u, path="/tangguh_no_such_database"), ['database "tangguh_no_such_database" does not']),
    (lambda u: u.replace("postgresql://", f"postgressql://app:{SECRET}@"), ["unknown broker scheme 'postgressql'"]),
])
def test_postgres_url_that_can_never_work_exits_2_at_start(tmp_path, postgres_url, mangle, words):
    result, _ = _run_once(tmp_path, mangle(postgres_url))
    _assert_refused(result, "broker.url", *words)


@pytest.mark.parametrize("mangle, words", [
    (lambda u: _with(u, bogus_option=1), ["unknown option(s) bogus_option"]),
    (lambda u: url_with(u, port=99999), ["Port out of range"]),
    (lambda u: url_with(u, path="/4242"), ["DB index is out of range"]),
])
def test_redis_url_that_can_never_work_exits_2_at_start(tmp_path, redis_url, mangle, words):
    result, _ = _run_once(tmp_path, mangle(redis_url))
    _assert_refused(result, "broker.url", *words)


@pytest.mark.parametrize("query, words", [
    ("bogus_option=1", ["unknown option(s) bogus_option"]),
    ("busy_timeout=abc", ["busy_timeout must be seconds"]),
    ("synchronous=off", ["synchronous must be full or normal"]),
])
def test_sqlite_url_that_can_never_work_exits_2_at_start_and_fails_config_check(tmp_path, query, words):
    """As on Redis and PostgreSQL: it exited 1 (systemd restarted it) and config check said ok."""
    result, path = _run_once(tmp_path, f"sqlite:///{tmp_path}/broker.db?{query}")
    _assert_refused(result, "broker.url", *words)
    check = tangguh("config", "check", "-c", str(path))
    assert (check.returncode, check.stdout) == (2, "")
    assert check.stderr == result.stderr.strip().splitlines()[-1] + "\n"
    assert not (tmp_path / "broker.db").exists()


@pytest.mark.parametrize("toolkit, words", [
    ({"redis_url": "redis://127.0.0.1:6379/0?prefix=app:&bogus=1"}, ["toolkit.redis_url: unknown option bogus"]),
    ({"redis_url": "redis://127.0.0.1:6379/0?socket_timeout=soon"}, ["toolkit.redis_url:", "socket_timeout"]),
    ({"database_url": "postgresql://app@127.0.0.1/app?schema=billing&bogus=1"},
     ['toolkit.database_url: invalid connection option "bogus"']),
])
def test_a_toolkit_url_its_driver_cannot_use_fails_start_config_check_and_reload(tmp_path, toolkit, words):
    """It passed config check and run; every job using ctx.lock, ctx.cache or ctx.transaction then
    failed at its first use of the URL, one attempt after another."""
    os.makedirs(tmp_path / "handlers", exist_ok=True)
    path = tmp_path / "tangguh.toml"
    with open(path, "wb") as f:
        tomli_w.dump({"supervisor": {"socket": str(tmp_path / "t.sock")}, "toolkit": toolkit,
                      "broker": {"url": f"sqlite:///{tmp_path}/broker.db"}, "log": {"format": "json"}}, f)
    for args in (["config", "check"], ["run"]):
        result = tangguh(*args, "-c", str(path), env=daemon_env())
        _assert_refused(result, *words)
    # The same URL brought in by a reload: the reload fails, the running generation stays.
    d = Daemon(tmp_path / "reload").start()
    try:
        d.config["toolkit"] = toolkit
        d.write_config()
        d.signal(signal.SIGHUP)
        wait_for(lambda: d.status().get("reload_error"), timeout=30, message="the reload refused")
        assert words[0] in d.status()["reload_error"] and d.status()["generation"] == 1
    finally:
        d.stop()


@pytest.mark.parametrize("table", ["jobs", "supervisors"])
def test_a_sqlite_file_holding_an_application_table_fails_config_check_as_run_refuses_it(tmp_path, table):
    """run exited 2 on another application's table under one of Tangguh's names, while config
    check, which only read the URL, said ok. The check opens the file read-only: it writes nothing."""
    import sqlite3

    db = tmp_path / "broker.db"
    with sqlite3.connect(db) as app:
        app.execute(f"CREATE TABLE {table} (id INTEGER PRIMARY KEY, title TEXT)")
    app.close()
    result, path = _run_once(tmp_path, f"sqlite:///{db}")
    _assert_refused(result, f"has a {table} table that is not Tangguh's")
    check = tangguh("config", "check", "-c", str(path))
    assert (check.returncode, check.stdout) == (2, "")
    assert check.stderr == result.stderr.strip().splitlines()[-1] + "\n"
    with sqlite3.connect(db) as app:
        assert app.execute("SELECT name FROM sqlite_master").fetchall() == [(table,)]
    app.close()


@pytest.mark.parametrize("problem, words", [
    ("long_socket", ["supervisor.socket", "over the 107"]),
    ("no_socket_dir", ["supervisor.socket: folder", "does not exist"]),
    ("no_handlers", ["supervisor.handlers", "tangguh config init"]),
    ("no_group", ["supervisor.socket_group: cannot give", "'tangguh-no-such-group': no such group"]),
    # config check said ok, then run refused it: docs/operating.md promises the same line from both.
    ("socket_is_a_file", ["supervisor.socket:", "exists and is not a socket; not replacing it"]),
])
def test_config_check_catches_what_run_rejects_at_start(tmp_path, problem, words):
    options = {
        "long_socket": {"socket": str(tmp_path / ("s" * 120 + ".sock"))},
        "no_socket_dir": {"socket": str(tmp_path / "missing" / "t.sock")},
        "no_handlers": {"handlers": str(tmp_path / "no-handlers-here")},
        "no_group": {"socket_group": "tangguh-no-such-group"},
        "socket_is_a_file": {"socket": str(tmp_path / "a-plain-file")},
    }[problem]
    (tmp_path / "a-plain-file").write_text("kept\n")
    result, path = _run_once(tmp_path, f"sqlite:///{tmp_path}/broker.db", **options)
    _assert_refused(result, *words)
    check = tangguh("config", "check", "-c", str(path))
    assert (check.returncode, check.stdout) == (2, "")
    assert check.stderr == result.stderr.strip().splitlines()[-1] + "\n"


def test_config_check_passes_a_socket_folder_under_run_that_systemd_makes_at_start(tmp_path):
    """The installed config's socket is /run/tangguh/tangguh.sock, a folder systemd makes when the
    service starts (RuntimeDirectory=) and that is gone while it is stopped (and after a boot):
    `tangguh config check -c /etc/tangguh/config.toml`, the step docs/service.md runs before the
    first start, exited 2 on a config that starts. It warns instead; run still refuses it."""
    folder = f"/run/tangguh-test-{uuid.uuid4().hex[:10]}"
    result, path = _run_once(tmp_path, f"sqlite:///{tmp_path}/broker.db", socket=f"{folder}/tangguh.sock")
    _assert_refused(result, f"supervisor.socket: folder {folder} does not exist")
    check = tangguh("config", "check", "-c", str(path))
    assert (check.returncode, check.stdout) == (0, f"ok: {path}\n"), check.stderr
    assert check.stderr.startswith(f"tangguh: warning: supervisor.socket: folder {folder} does not exist now")
    assert "RuntimeDirectory=" in check.stderr and check.stderr.count("\n") == 1
    assert not os.path.exists(folder)


# -- status while the config file is broken ------------------------------------------------

@pytest.mark.parametrize("breakage, said", [(b"\n[broken\n", "invalid TOML"),
                                            (b"\n# caf\xe9 (saved as Latin-1)\n", "not UTF-8")])
def test_status_works_while_the_config_is_broken_and_with_socket_alone(tmp_path, breakage, said):
    d = Daemon(tmp_path)
    try:
        d.start()
        with open(d.config_path, "ab") as f:
            f.write(breakage)
        d.signal(signal.SIGHUP)
        wait_for(lambda: d.status()["reload_error"], message="the reload to fail")
        for command in (["status"], ["status", "--json"], ["metrics"]):
            result = tangguh(*command, "-c", d.config_path)
            assert result.returncode == 0, result.stderr
            assert result.stderr.startswith("tangguh: warning: ") and said in result.stderr
            assert result.stderr.count("\n") == 1 and d.socket in result.stderr
        text = tangguh("status", "-c", d.config_path).stdout
        assert "RELOAD FAILED (running the previous generation)" in text and said in text
        assert "generation 1" in text
        reply = json.loads(tangguh("status", "--json", "-c", d.config_path).stdout)
        assert reply["generation"] == 1 and said in reply["reload_error"]
        # No config at all (an empty folder): --socket is enough.
        empty = tmp_path / "elsewhere"
        empty.mkdir()
        for command in (["status", "--json"], ["metrics"]):
            result = tangguh(*command, "--socket", d.socket, cwd=empty)
            assert (result.returncode, result.stderr) == (0, "")
        assert json.loads(tangguh("status", "--json", "--socket", d.socket, cwd=empty).stdout)["pid"] == d.proc.pid
        d.signal(signal.SIGTERM)
        assert d.wait_exit() == 0
    finally:
        d.stop()



def test_a_config_that_is_not_utf8_is_a_config_error_naming_the_byte(tmp_path):
    """TOML is UTF-8. A config saved as Latin-1 was an internal error (exit 1: systemd
    restarts it in a loop), not the exit 2 of every other unreadable config."""
    path = tmp_path / "tangguh.toml"
    path.write_bytes(b"# caf\xe9\n[supervisor]\nworkers = 2\n")
    for command in (["config", "check"], ["run"]):
        result = tangguh(*command, "-c", str(path))
        assert result.returncode == 2, result.stderr
        assert result.stderr == f"tangguh: error: {path}: not UTF-8 text (byte 5: b'\\xe9'); save it as UTF-8\n"

def test_socket_path_is_read_leniently_from_a_broken_config(tmp_path):
    from supervisor import config

    path = tmp_path / "c.toml"
    path.write_text('[broker]\nsocket = "not-this"\n[supervisor]\nworkers = "x\n  socket = \'run/t.sock\'\n[x\n')
    assert config.socket_path(str(path)) == str(tmp_path / "run" / "t.sock")
    path.write_text("[supervisor\n")
    assert config.socket_path(str(path)) == str(tmp_path / "tangguh.sock")
    assert config.socket_path(str(tmp_path / "missing.toml")) == str(tmp_path / "tangguh.sock")


# -- the README's "Run it", verbatim ----------------------------------------------------------

def test_config_init_then_run_then_the_readme_job_is_done(tmp_path):
    def cli(*args):
        return tangguh(*args, cwd=tmp_path)

    assert cli("config", "init", "tangguh.toml").returncode == 0
    assert cli("config", "check", "-c", "tangguh.toml").returncode == 0
    proc = subprocess.Popen([sys.executable, "-m", "supervisor.cli", "run", "-c", "tangguh.toml"], cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            env=daemon_env())
    try:
        wait_for(lambda: cli("status", "--json").returncode == 0, timeout=30, message="the supervisor to answer")
        job_id = cli("enqueue", "hash_chain", "--payload", '{"rounds": 100000}').stdout.strip()
        wait_for(lambda: json.loads(cli("job", job_id, "--json").stdout)["state"] in ("done", "dead"), timeout=60,
                 message="the job to finish")
        job = json.loads(cli("job", job_id, "--json").stdout)
        assert (job["state"], job["reason"]) == ("done", None), job
        assert len(job["result"]["digest"]) == 64
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def test_run_without_a_handlers_folder_says_to_run_config_init(tmp_path):
    (tmp_path / "tangguh.toml").write_text("")
    result = tangguh("run", "-c", "tangguh.toml", cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "supervisor.handlers" in result.stderr and "tangguh config init" in result.stderr


# -- the version ------------------------------------------------------------------------------

def test_version_on_the_command_line_and_in_status(tmp_path):
    result = tangguh("--version")
    expected = f"tangguh {supervisor.__version__} (Python {platform.python_version()})\n"
    assert (result.returncode, result.stdout) == (0, expected)
    d = Daemon(tmp_path)
    try:
        d.start()
        assert d.status()["version"] == supervisor.__version__
        first = tangguh("status", "-c", d.config_path).stdout.splitlines()[0]
        assert f"version {supervisor.__version__}" in first
    finally:
        d.stop()
