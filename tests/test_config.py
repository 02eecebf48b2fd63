"""Config files: defaults, errors that name the key path, path resolution, and the
``tangguh config check|show|init`` commands."""
import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import tomllib

import pytest

from supervisor import cli, config
from supervisor.errors import ConfigError

from .util import url_with

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "config.example.toml")
PACKAGED_EXAMPLE = os.path.join(ROOT, "supervisor", "data", "config.example.toml")


def write(tmp_path, body, name="tangguh.toml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def load_text(tmp_path, body):
    return config.load(write(tmp_path, body))


def tangguh(capsys, *args):
    code = cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


# -- defaults -----------------------------------------------------------------

def test_an_empty_file_is_all_defaults(tmp_path):
    cfg = load_text(tmp_path, "")
    assert cfg.path == str(tmp_path / "tangguh.toml")
    assert cfg.supervisor.workers == 2 and cfg.supervisor.socket_mode == 0o660
    assert cfg.broker.queues == ["default"] and cfg.broker.lease_seconds == 30.0 and cfg.broker.migrate is True
    assert cfg.jobs.max_attempts == 5 and cfg.jobs.types == {} and cfg.log.level == "info"
    assert cfg.metrics.listen == ""
    assert cfg.broker.url == f"sqlite:///{tmp_path}/tangguh.db"
    assert cfg.supervisor.handlers == str(tmp_path / "handlers")
    assert cfg.supervisor.socket == str(tmp_path / "tangguh.sock")


def test_no_config_file_anywhere_means_defaults_relative_to_the_working_folder(tmp_path, monkeypatch):
    if os.path.exists("/etc/tangguh/config.toml"):
        pytest.skip("/etc/tangguh/config.toml exists on this machine")
    monkeypatch.chdir(tmp_path)
    assert config.find_config() is None
    cfg = config.load()
    assert cfg.path is None and cfg.supervisor.socket == str(tmp_path / "tangguh.sock")


def test_tangguh_toml_in_the_working_folder_is_found(tmp_path, monkeypatch):
    write(tmp_path, "[supervisor]\nworkers = 7\n")
    monkeypatch.chdir(tmp_path)
    assert config.load().supervisor.workers == 7


def test_values_are_read(tmp_path):
    cfg = load_text(tmp_path, """
        [supervisor]
        workers = 8
        graceful_timeout = 5
        [broker]
        url = "redis://cache:6379/2"
        queues = ["critical", "default"]
        lease_seconds = 10
        heartbeat_seconds = 2.5
        [jobs]
        jitter = 0
        [jobs.types.send_email]
        timeout = 20
        queue = "critical"
        [log]
        format = "json"
    """)
    assert cfg.supervisor.workers == 8 and cfg.supervisor.graceful_timeout == 5.0
    assert cfg.broker.url == "redis://cache:6379/2"  # only sqlite URLs are paths
    assert cfg.broker.queues == ["critical", "default"] and cfg.broker.heartbeat_seconds == 2.5
    assert cfg.jobs.jitter == 0.0 and cfg.log.format == "json"
    assert cfg.job_type("send_email").timeout == 20.0 and cfg.job_type("send_email").queue == "critical"
    assert cfg.job_type("send_email").max_attempts is None and cfg.job_type("other").timeout is None


# -- errors name the key path -----------------------------------------------------

BAD = [
    ("[supervisor]\nworkers = 0", "supervisor.workers: expected an integer from 1 to 1024, got 0"),
    ("[supervisor]\nworkers = \"two\"", 'supervisor.workers: expected an integer from 1 to 1024, got "two"'),
    ("[supervisor]\nworkers = true", "supervisor.workers: expected an integer from 1 to 1024, got true"),
    ("[supervisor]\nworkers = 2.5", "supervisor.workers: expected an integer from 1 to 1024, got 2.5"),
    ("[supervisor]\nworkers = 5000", "supervisor.workers: expected an integer from 1 to 1024, got 5000"),
    ("[supervisor]\nsocket_mode = -1", "supervisor.socket_mode: expected a file mode from 0o000 to 0o777"),
    # Written in decimal (600 for 0o600), a mode was taken modulo 0o1000: the socket came out --x-wx---,
    # closed to its owner, the service's user, and open to its group.
    ("[supervisor]\nsocket_mode = 600", "supervisor.socket_mode: expected a file mode from 0o000 to 0o777 (octal, as"
                                       " 0o660), got 600"),
    ("[supervisor]\nhandlers = 3", "supervisor.handlers: expected a string, got 3"),
    ("[supervisor]\ngraceful_timeout = 0", "supervisor.graceful_timeout: expected a positive number"),
    ("[supervisor]\npoll_interval = nan", "supervisor.poll_interval: expected a number of seconds >= 0.001"),
    # `tangguh run` and `config check` failed with "internal error: OverflowError" (the trial import's wait).
    ("[supervisor]\nimport_timeout = 1e300", "supervisor.import_timeout: expected a positive number of seconds up"
     " to 31536000 (a year), got 1e+300"),
    # An idle master polling every microsecond spun a core.
    ("[supervisor]\npoll_interval = 0.000001", "supervisor.poll_interval: expected a number of seconds >= 0.001"),
    ("[broker]\nlease_seconds = \"abc\"",
     'broker.lease_seconds: expected a positive number of seconds up to 86400 (a day), got "abc"'),
    ("[broker]\nqueues = []", "broker.queues: expected a non-empty list of distinct names"),
    ("[broker]\nqueues = [\"a\", \"a\"]", "broker.queues: expected a non-empty list of distinct names"),
    ("[broker]\nqueues = \"default\"", "broker.queues: expected a non-empty list"),
    ("[broker]\nmigrate = \"yes\"", 'broker.migrate: expected true or false, got "yes"'),
    ("[broker]\nprefetch = -1", 'broker.prefetch: expected "auto" or an integer from 0 to 2147483647, got -1'),
    ('[broker]\nprefetch = "some"', 'broker.prefetch: expected "auto" or an integer from 0 to 2147483647, got "some"'),
    ("[broker]\nretention = -1.0", "broker.retention: expected a number of seconds from 0 to 315360000"),
    ("[broker]\nurl = 5", "broker.url: expected a string, got 5"),
    ("[broker]\nurl = \"ftp://x/y\"", "broker.url: unknown broker scheme 'ftp'"),
    ("[broker]\nurl = \"just-a-file.db\"", "broker.url: broker url is not a URL"),
    ("[broker]\nurl = \"sqlite:///\"", "broker.url: 'sqlite:///' names no database file"),
    # Two slashes: the first folder was read as a host and dropped, and /var/lib/t.db became <config dir>/lib/t.db.
    ("[broker]\nurl = \"sqlite://var/lib/t.db\"", "broker.url: 'sqlite://var/lib/t.db' names no database file"),
    ("[toolkit]\ndatabase_url = \"sqlite://srv/app.db\"", "toolkit.database_url: 'sqlite://srv/app.db' names no"),
    ("[broker]\nlease_seconds = 5\nheartbeat_seconds = 5",
     "broker.heartbeat_seconds: must be shorter than broker.lease_seconds (5), got 5"),
    ("[jobs]\njitter = 1.5", "jobs.jitter: expected a number between 0 and 1, got 1.5"),
    # A retry was put off past the ten years an enqueue's delay or a RetryLater may have (run_at
    # 9e299: never run, and the console's job page failed with an internal error).
    ("[jobs]\nbackoff_cap = 1e308", "jobs.backoff_cap: expected a number of seconds >= 0 and up to 315360000"),
    ("[jobs]\nbackoff_base = 1e300", "jobs.backoff_base: expected a number of seconds >= 0 and up to 315360000"),
    ("[jobs]\nmax_attempts = 0", "jobs.max_attempts: expected a positive integer up to 2147483647, got 0"),
    ("[jobs]\ntypes = 3", "jobs.types: expected a table"),
    ("[jobs.types.mail]\ntimeout = -1", "jobs.types.mail.timeout: expected a positive number of seconds up to"
     " 31536000 (a year), got -1"),
    # Past what an enqueue's timeout may be: a soft timeout's timer overflowed (setitimer) and every
    # job failed as an OverflowError before its handler ran.
    ("[jobs]\nsoft_timeout = 1e300", "jobs.soft_timeout: expected a number of seconds >= 0 and up to 31536000"),
    ("[jobs.types.mail]\nsoft_timeout = 1e12", "jobs.types.mail.soft_timeout: expected a number of seconds >= 0"),
    ("[jobs]\ntimeout = 1e300", "jobs.timeout: expected a positive number of seconds up to 31536000 (a year)"),
    ("[jobs.types.mail]\ntimeout = 31536001", "jobs.types.mail.timeout: expected a positive number of seconds"),
    ("[jobs.types.mail]\nqueue = \"\"", 'jobs.types.mail.queue: expected a queue name (1 to 64 letters, digits or'
     ' _ . : -), got ""'),
    # Braces are a Redis hash tag: such a queue broke every claim that reached it.
    ("[broker]\nqueues = [\"default\", \"a{b}\"]", "broker.queues: 'a{b}' is not a queue name (1 to 64 letters,"),
    ("[broker]\nqueues = [\"two words\"]", "broker.queues: 'two words' is not a queue name"),
    ("[broker]\nqueues = [\"%s\"]" % ("q" * 65), "broker.queues: '%s' is not a queue name" % ("q" * 65)),
    ("[jobs.types.mail]\nqueue = \"{x}\"", "jobs.types.mail.queue: expected a queue name"),
    ("[schedules.s]\ncron = \"* * * * *\"\ntype = \"t\"\nqueue = \"x}\"", "schedules.s.queue: expected a queue name"),
    ("[schedules.s]\ncron = \"0 0 31 2 *\"\ntype = \"t\"", 'schedules.s.cron: "0 0 31 2 *" matches no date'),
    # Every tick of it failed in the master's loop as a broker outage (PostgreSQL), pausing claims.
    ("[schedules.s]\ncron = \"* * * * *\"\ntype = \"t\"\npayload = { s = \"a\\u0000b\" }",
     "schedules.s.payload: payload contains a NUL character"),
    ("[jobs.types.mail]\nqueue = \"nope\"", "jobs.types.mail.queue: 'nope' is not in broker.queues"),
    ("[log]\nlevel = \"loud\"", "log.level: expected one of 'debug', 'info', 'warning', 'error', got \"loud\""),
    ("[log]\nformat = 1", "log.format: expected one of"),
    ("[metrics]\nlisten = 9100", "metrics.listen: expected a string, got 9100"),
    # Passed `config check`; `run` then logged "metrics endpoint not started" and served no metrics.
    ("[metrics]\nlisten = \"9100\"", "metrics.listen: expected \"host:port\""),
    ("[metrics]\nlisten = \"[::1:9100\"", "metrics.listen: expected \"host:port\""),
    # Read as ::1 port 80 (the bracket dropped): a typo served on an address nobody named.
    ("[web]\nlisten = \"[::1:80\"", "web.listen: expected \"host:port\""),
    ("[web]\nlisten = \"::1]:80\"", "web.listen: expected \"host:port\""),
    ("broker = 3", "broker: expected a table"),
]


@pytest.mark.parametrize("body,message", BAD, ids=[m.split(":")[0] + "-" + str(i) for i, (_, m) in enumerate(BAD)])
def test_bad_values_name_the_key_path(tmp_path, body, message):
    with pytest.raises(ConfigError) as info:
        load_text(tmp_path, body)
    assert str(info.value).startswith(message), str(info.value)


def test_unknown_keys_and_sections_are_errors(tmp_path):
    for body, message in (("[broker]\nlease_secs = 3", "broker.lease_secs: unknown key"),
                          ("[jobs.types.mail]\ntimeuot = 3", "jobs.types.mail.timeuot: unknown key"),
                          ("[brokr]\nurl = \"sqlite:///x.db\"", "brokr: unknown section"),
                          ("workers = 3", "workers: unknown section")):
        with pytest.raises(ConfigError, match="^" + message.replace(".", r"\.") + "$"):
            load_text(tmp_path, body)


def test_relative_paths_resolve_against_the_file_folder(tmp_path, monkeypatch):
    conf_dir = tmp_path / "etc"
    conf_dir.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = load_text(conf_dir, """
        [supervisor]
        handlers = "../app/handlers"
        socket = "run/tangguh.sock"
        [broker]
        url = "sqlite:///data/q.db?synchronous=normal"
    """)
    assert cfg.supervisor.handlers == str(tmp_path / "app" / "handlers")
    assert cfg.supervisor.socket == str(conf_dir / "run" / "tangguh.sock")
    assert cfg.broker.url == f"sqlite:///{conf_dir}/data/q.db?synchronous=normal"
    absolute = load_text(conf_dir, '[supervisor]\nsocket = "/run/t.sock"\n[broker]\nurl = "sqlite:////var/q.db"\n')
    assert absolute.supervisor.socket == "/run/t.sock" and absolute.broker.url == "sqlite:////var/q.db"


def test_unreadable_missing_and_invalid_files(tmp_path):
    folder = tmp_path / "a-folder.toml"
    folder.mkdir()  # unreadable as a file, even for root
    with pytest.raises(ConfigError, match=f"^{folder}: cannot read: "):
        config.load(str(folder))
    with pytest.raises(ConfigError, match="no such config file"):
        config.load(str(tmp_path / "missing.toml"))
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_text(tmp_path, "[broker\nurl = 3")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_text(tmp_path, '[broker]\nurl = "a"\nurl = "b"\n')
    # Arrays nested thousands deep made tomllib raise RecursionError (exit 1, "internal error"), and
    # a file that never ends (/dev/zero named by mistake) was read into memory whole.
    with pytest.raises(ConfigError, match="invalid TOML: nested too deep"):
        load_text(tmp_path, "a = " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(ConfigError, match="/dev/zero: over 16 MiB: not a config file"):
        config.load("/dev/zero")


# -- tangguh config check / show / init ----------------------------------------------

def test_config_check(capsys, tmp_path):
    good = write(tmp_path, "[supervisor]\nworkers = 3\n")
    (tmp_path / "handlers").mkdir()
    assert tangguh(capsys, "config", "check", "-c", good) == (0, f"ok: {good}\n", "")
    bad = write(tmp_path, "[broker]\nlease_seconds = \"abc\"\n", name="bad.toml")
    code, out, err = tangguh(capsys, "config", "check", "-c", bad)
    assert (code, out) == (2, "")
    assert err == ('tangguh: error: broker.lease_seconds: expected a positive number of seconds up to 86400'
                   ' (a day), got "abc"\n')
    code, out, err = tangguh(capsys, "config", "check", "-c", tmp_path / "missing.toml")
    assert code == 2 and err == f"tangguh: error: {tmp_path / 'missing.toml'}: no such config file\n"
    code, out, err = tangguh(capsys, "config", "check", "-c", write(tmp_path, "[x\n", name="broken.toml"))
    assert code == 2 and err.startswith("tangguh: error: ") and "invalid TOML" in err and err.count("\n") == 1


def test_config_check_asks_the_broker_server_what_run_would(capsys, tmp_path, redis_url, postgres_url):
    """It said "ok" to a broker URL `run` refuses at once (exit 2: an unknown option, an
    unknown database); one round trip now says what `run` would. A server that does not
    answer is a warning: `run` waits it out."""
    (tmp_path / "handlers").mkdir()
    refused = {f"{redis_url}&bogus=1": "unknown option(s) bogus",
               url_with(redis_url, path="/99"): "DB index is out of range",
               url_with(postgres_url, path="/no_such_database"): "no_such_database"}
    for url, said in refused.items():
        code, out, err = tangguh(capsys, "config", "check", "-c", write(tmp_path, f'[broker]\nurl = "{url}"\n'))
        assert (code, out) == (2, "") and err.startswith("tangguh: error: broker.url: ") and said in err, err
        assert err.count("\n") == 1
    for url in (redis_url, postgres_url):
        assert tangguh(capsys, "config", "check", "-c", write(tmp_path, f'[broker]\nurl = "{url}"\n'))[0] == 0
    silent = write(tmp_path, '[broker]\nurl = "redis://127.0.0.1:1/0"\n')
    code, out, err = tangguh(capsys, "config", "check", "-c", silent)
    assert (code, out) == (0, f"ok: {silent}\n") and err.startswith("tangguh: warning: broker.url: not reachable now")


def test_config_check_as_a_process_prints_no_traceback(tmp_path):
    bad = write(tmp_path, "[jobs.types.mail]\nqueue = \"nope\"\n")
    result = subprocess.run([sys.executable, "-m", "supervisor.cli", "config", "check", "-c", bad],
                            capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == "tangguh: error: jobs.types.mail.queue: 'nope' is not in broker.queues\n"


def test_config_show_round_trips_through_tomllib(capsys, tmp_path):
    path = write(tmp_path, """
        [supervisor]
        workers = 4
        socket_mode = 0o600
        [broker]
        queues = ["high", "default"]
        [jobs.types.mail]
        timeout = 12.5
        queue = "high"
        [jobs.types.report]
        max_attempts = 1
        [metrics]
        listen = "127.0.0.1:9187"
    """)
    cfg = config.load(path)
    code, out, _ = tangguh(capsys, "config", "show", "-c", path)
    assert code == 0 and out.startswith(f"# effective config from {path}\n")
    shown = tomllib.loads(out)
    assert shown == cfg.to_dict()
    assert shown["jobs"]["types"] == {"mail": {"timeout": 12.5, "queue": "high"}, "report": {"max_attempts": 1}}
    # What it prints is itself a valid config that means the same thing.
    again = config.from_dict(shown, str(tmp_path / "somewhere-else"))
    assert again.to_dict() == cfg.to_dict()

    code, out, _ = tangguh(capsys, "config", "show", "--json", "-c", path)
    assert code == 0 and json.loads(out) == cfg.to_dict()


def test_config_show_masks_passwords_and_credential_hashes(capsys, tmp_path):
    hashed = "$argon2id$v=19$m=65536,t=3,p=4$c2FsdHNhbHQ$aGFzaGhhc2hoYXNo"
    path = write(tmp_path, f"""
        [broker]
        url = "redis://:s3cret@127.0.0.1:6379/0"
        [toolkit]
        database_url = "postgresql://app:pgpass@db.internal/app"
        [web.users.alice]
        password = "{hashed}"
        role = "admin"
        [web.tokens.ci]
        sha256 = "{'ab' * 32}"
        role = "viewer"
    """)
    for extra in ((), ("--json",)):
        code, out, _ = tangguh(capsys, "config", "show", *extra, "-c", path)
        assert code == 0
        for secret in ("s3cret", "pgpass", hashed, "ab" * 32):
            assert secret not in out
        assert "redis://:***@127.0.0.1:6379/0" in out and "postgresql://app:***@db.internal/app" in out
    # Asked for, the secrets are printed: the output is again a config that loads the same.
    code, out, _ = tangguh(capsys, "config", "show", "--show-secrets", "-c", path)
    assert code == 0 and tomllib.loads(out) == config.load(path).to_dict()


def test_config_init_writes_the_example_and_refuses_to_overwrite(capsys, tmp_path):
    target = tmp_path / "new.toml"
    code, out, _ = tangguh(capsys, "config", "init", target)
    example = tmp_path / "handlers" / "examples.py"
    assert (code, out) == (0, f"wrote {target}\nmade {tmp_path / 'handlers'}/ (drop handler modules here)\n"
                              f"wrote {example} (example handlers: hash_chain, sleep, flaky, always_permanent)\n")
    assert (tmp_path / "handlers").is_dir()  # the folder the starter config names: `run` can start at once
    with open(EXAMPLE) as f:
        assert target.read_text() == f.read()
    assert tangguh(capsys, "config", "check", "-c", target)[0] == 0

    target.write_text("# mine\n")
    code, out, err = tangguh(capsys, "config", "init", target)
    assert (code, out) == (2, "")
    assert err == f"tangguh: error: {target}: already exists, not overwriting it\n"
    assert target.read_text() == "# mine\n"


def test_config_init_into_a_folder_that_does_not_exist_is_bad_input(capsys, tmp_path):
    """It exited 1 (`No such file or directory`), the code of a runtime failure, for a wrong path."""
    missing = tmp_path / "nope"
    for target in (missing / "tangguh.toml", missing / "deeper" / "tangguh.toml"):
        code, out, err = tangguh(capsys, "config", "init", target)
        assert (code, out) == (2, "")
        assert err == f"tangguh: error: config init: folder {target.parent} does not exist (make it first)\n"
    (tmp_path / "file").write_text("")
    code, _, err = tangguh(capsys, "config", "init", tmp_path / "file" / "tangguh.toml")
    assert code == 2 and err == f"tangguh: error: config init: {tmp_path / 'file'} is not a folder\n"
    assert not missing.exists()


# -- config.example.toml ----------------------------------------------------------

def test_packaged_example_is_identical_to_the_root_one():
    with open(EXAMPLE, "rb") as a, open(PACKAGED_EXAMPLE, "rb") as b:
        assert a.read() == b.read(), "copy config.example.toml to supervisor/data/ (they must stay identical)"


def test_example_lists_every_key_with_its_default(tmp_path):
    with open(EXAMPLE, "rb") as f:
        example = tomllib.load(f)
    for section, cls in config.SECTIONS.items():
        # Tables of names (users, tokens) are shown commented: an empty ``users = {}`` made the
        # README's [web.users.NAME] blocks appended to a starter config a TOML error.
        keys = {f.name for f in dataclasses.fields(cls)} - {"types", "users", "tokens"}
        assert set(example[section]) == keys, section
    # Every value shown is the default, so the example means exactly "all defaults".
    assert config.from_dict(example, str(tmp_path)).to_dict() == config.from_dict({}, str(tmp_path)).to_dict()


def test_the_readmes_web_users_and_tokens_appended_to_a_starter_config_parse():
    with open(EXAMPLE) as f:
        starter = f.read()
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    block = readme[readme.index("[web.users.ada]"):]
    block = block[:block.index("```")]
    web = tomllib.loads(starter + "\n" + block)["web"]  # was: "Cannot declare ('web', 'users', 'ada') twice"
    assert set(web["users"]) == {"ada", "vic"} and set(web["tokens"]) == {"deploy-script"}


def test_example_documents_every_key_and_a_job_type_block():
    with open(EXAMPLE) as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        if "=" in line and not line.startswith("#"):
            assert lines[i - 1].startswith("#"), f"no comment above {line!r}"
    # The commented [jobs.types.example] block is valid once uncommented, and shows every per-type key.
    start = lines.index("# [jobs.types.example]")
    block = []
    for line in lines[start:]:
        if not line.startswith("# "):
            break
        if not line.startswith("# # "):
            block.append(line[2:])
    parsed = tomllib.loads("\n".join(block))
    assert set(parsed["jobs"]["types"]["example"]) == {f.name for f in dataclasses.fields(config.JobTypeConfig)}
    config.from_dict(parsed)


def test_example_passes_config_check_as_a_process():
    result = subprocess.run([sys.executable, "-m", "supervisor.cli", "config", "check", "-c", EXAMPLE],
                            capture_output=True, text=True, cwd="/", timeout=60)
    assert (result.returncode, result.stdout, result.stderr) == (0, f"ok: {EXAMPLE}\n", "")
    cfg = config.load(EXAMPLE)
    assert cfg.broker.url == f"sqlite:///{ROOT}/tangguh.db"
    assert cfg.supervisor.handlers == os.path.join(ROOT, "handlers")
    assert cfg.supervisor.socket == os.path.join(ROOT, "tangguh.sock")
