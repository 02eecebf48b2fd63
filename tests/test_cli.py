"""The producer API (``supervisor.client``) and the ``tangguh`` command line.

Most commands run in-process through ``cli.main`` (fast); the error contract
(exit code, exactly one line on stderr, no traceback, nothing written) is
checked on real processes, as an operator or a script would see it.
"""
import json
import argparse
import os
import socket
import subprocess
import sys
import textwrap
import threading
import uuid

import pytest

from supervisor import cli
from supervisor.backends import open_broker
from supervisor.cli.daemon import render_status
from supervisor.client import Client
from supervisor.errors import BadInput, BrokerError
from supervisor.model import NewJob, error_info
from supervisor.urls import redact

from .util import wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def cfg_path(tmp_path):
    path = tmp_path / "tangguh.toml"
    path.write_text(textwrap.dedent("""
        [broker]
        url = "sqlite:///broker.db"
        queues = ["default", "bulk"]

        [jobs]
        max_attempts = 4

        [jobs.types.report]
        queue = "bulk"
        max_attempts = 2
        timeout = 9.0
    """))
    return str(path)


@pytest.fixture
def db_path(tmp_path):
    return str(tmp_path / "broker.db")


@pytest.fixture
def broker(cfg_path, db_path):
    b = open_broker("sqlite:///" + db_path)
    yield b
    b.close()


def tangguh(capsys, *args):
    """Run the CLI in-process: (exit code, stdout, stderr)."""
    code = cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def tangguh_process(*args, cwd=None):
    """Run the CLI as its own process."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TANGGUH_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "supervisor.cli", *map(str, args)], capture_output=True,
                          text=True, cwd=cwd or ROOT, env=env, timeout=60)


def enqueue(capsys, cfg_path, type_="email", payload='{"to": "a@b"}', *extra):
    code, out, err = tangguh(capsys, "enqueue", type_, "--payload", payload, "-c", cfg_path, *extra)
    assert code == 0, err
    job_id = out.strip()
    assert job_id.startswith("job_") and "\n" not in job_id
    return job_id


def make_dead(broker, type_="email", payload=None, message="boom"):
    """A dead-lettered job, put there through the broker API (claim + dead)."""
    job_id = broker.enqueue(NewJob(type_, payload or {"n": 1}, priority=1_000_000))  # claimed first
    [job] = broker.claim(["default"], 1, 30, "test-owner")
    assert job.id == job_id
    error = error_info("exception", "ValueError", message, "Traceback (most recent call last):\n  ...\nValueError: "
                       + message)
    broker.dead(job.lease, "exception", error, info={"pid": 4242})
    return job_id


def counts(broker, queues=("default", "bulk")):
    return {q: (s.ready, s.scheduled, s.in_flight, s.dead, s.done) for q, s in broker.stats(list(queues)).items()}


# -- the producer API ----------------------------------------------------------

def test_client_from_url_enqueue_get_stats(tmp_path):
    url = f"sqlite:///{tmp_path}/c.db"
    with Client.from_url(url) as client:
        job_id = client.enqueue("email", {"to": "x"}, resource_id="user:1", idempotency_key="k", priority=3,
                                trace_id="tr")
        assert client.enqueue("email", {"to": "y"}, idempotency_key="k") == job_id
        job = client.get(job_id)
        assert (job.type, job.queue, job.payload, job.resource_id, job.priority, job.trace_id) == (
            "email", "default", {"to": "x"}, "user:1", 3, "tr")
        assert client.get("job_missing") is None
        client.enqueue("later", {}, delay=3600)
        stats = client.stats()
        assert (stats["default"].ready, stats["default"].scheduled) == (1, 1)
        # A client from a URL alone knows no queue list: any queue name goes.
        client.enqueue("x", {}, queue="anything")
        assert client.stats(["anything"])["anything"].ready == 1


def test_client_from_config_applies_type_defaults_and_checks_queues(cfg_path, broker):
    with Client.from_config(cfg_path) as client:
        report = client.get(client.enqueue("report", {}))
        assert (report.queue, report.max_attempts, report.timeout) == ("bulk", 2, 9.0)
        email = client.get(client.enqueue("email", {}))
        # No per-type timeout: left unset so the supervisor applies the decorator's, then [jobs].timeout.
        assert (email.queue, email.max_attempts, email.timeout) == ("default", 4, None)
        explicit = client.get(client.enqueue("report", {}, queue="default", max_attempts=7, timeout=1.5))
        assert (explicit.queue, explicit.max_attempts, explicit.timeout) == ("default", 7, 1.5)
        with pytest.raises(BadInput, match="'nope'"):
            client.enqueue("email", {}, queue="nope")
    assert counts(broker)["default"][0] == 2 and counts(broker)["bulk"][0] == 1


def test_client_enqueue_many_takes_dicts_and_tuples_all_or_nothing(cfg_path, broker):
    with Client.from_config(cfg_path) as client:
        ids = client.enqueue_many([("email", {"i": 0}), ("report", {"i": 1}, {"priority": 2}),
                                   {"type": "email", "payload": {"i": 2}, "delay": 60}])
        assert [client.get(i).payload["i"] for i in ids] == [0, 1, 2]
        assert client.get(ids[1]).queue == "bulk" and client.get(ids[1]).priority == 2
        for bad in ([("email", {}), ("email", [1])], [("email", {}), {"type": "email"}],
                    [("email", {}), {"type": "e", "payload": {}, "colour": "red"}],
                    [("email", {}), ("email", {}, {"queue": "nope"})], ["email"]):
            with pytest.raises(BadInput, match="job 1|job 0"):
                client.enqueue_many(bad)
        assert client.enqueue_many([]) == []
    assert sum(sum(c) for c in counts(broker).values()) == 3


def test_client_opens_the_broker_lazily_and_rejects_unsupported_broker_kwargs(tmp_path):
    db = tmp_path / "lazy.db"
    client = Client.from_url(f"sqlite:///{db}")
    with pytest.raises(BadInput):
        client.enqueue("t", [1, 2])
    assert not db.exists()  # nothing was opened, let alone written
    with pytest.raises(BadInput, match="conn"):
        client.enqueue("t", {}, conn=object())
    assert client.stats()["default"].ready == 0
    client.close()
    client.close()  # idempotent
    with pytest.raises(BrokerError, match="scheme"):
        Client.from_url("ftp://example.com/q")


def test_client_passes_conn_to_the_postgres_outbox(postgres_url):
    """``conn=`` reaches the PostgreSQL broker: the job exists iff the producer's transaction commits."""
    pytest.importorskip("supervisor.backends.postgres")
    import psycopg

    with Client.from_url(postgres_url) as client:
        client.broker.migrate()
        with psycopg.connect(postgres_url.split("?")[0]) as conn:
            rolled_back = client.enqueue("email", {"n": 1}, conn=conn)
            conn.rollback()
            committed = client.enqueue_many([("email", {"n": 2})], conn=conn)[0]
            conn.commit()
        assert client.get(rolled_back) is None
        assert client.get(committed).payload == {"n": 2}


# -- enqueue, job, stats -------------------------------------------------------

@pytest.mark.parametrize("module", ["import os\nos._exit(0)\n", "import time\ntime.sleep(600)\n",
                                    "print('\\x1b[2Jhello')\n"], ids=["exits", "hangs", "prints"])
def test_a_handler_module_that_exits_hangs_or_prints_at_import_cannot_fool_enqueue(tmp_path, module):
    """``enqueue`` imports the handlers for their payload schemas, and ``config check`` for the
    schedules': a module that ended the process at import made both exit 0 having done nothing
    (the job lost), one that waited hung them, and what one printed came before the job id on
    stdout. Imported first in a throwaway process within ``import_timeout``, as ``run`` does."""
    handlers = tmp_path / "handlers"
    handlers.mkdir()
    (handlers / "jobs.py").write_text("import supervisor\n\n@supervisor.job('noop')\ndef noop(ctx, p):\n    return 1\n")
    (handlers / "zz.py").write_text(module)
    cfg = tmp_path / "t.toml"
    cfg.write_text(f'[supervisor]\nhandlers = "{handlers}"\nimport_timeout = 2\n'
                   f'[broker]\nurl = "sqlite:///{tmp_path / "b.db"}"\n')
    out = tangguh_process("-c", cfg, "enqueue", "noop")
    assert out.returncode == 0 and out.stdout.startswith("job_") and out.stdout.count("\n") == 1, out
    with open_broker(f"sqlite:///{tmp_path / 'b.db'}") as b:
        assert b.get(out.stdout.strip()).type == "noop"
    check = tangguh_process("-c", cfg, "config", "check")
    if "print" in module:
        assert check.returncode == 0 and check.stdout.startswith("ok: "), check
    else:
        assert check.returncode == 2 and check.stdout == "", check
        assert check.stderr.count("\n") == 1 and "supervisor.handlers" in check.stderr, check.stderr


def test_a_thread_a_handler_module_starts_at_import_does_not_keep_a_command_waiting(tmp_path):
    """A module that starts a thread at import (a metrics pusher, a consumer) without daemon=True:
    `config check`, `enqueue` and `schedules` had answered, then Python waited for the thread at
    exit, and the command hung for as long as it ran (for ever, for a poller). The daemon does not
    wait for such threads; neither does the command line."""
    handlers = tmp_path / "handlers"
    handlers.mkdir()
    (handlers / "jobs.py").write_text("import supervisor, threading, time\n\n"
                                      "threading.Thread(target=time.sleep, args=(3600,), name='pusher').start()\n\n"
                                      "@supervisor.job('noop')\ndef noop(ctx, p):\n    return 1\n")
    cfg = tmp_path / "t.toml"
    cfg.write_text(f'[supervisor]\nhandlers = "{handlers}"\nsocket = "{tmp_path / "t.sock"}"\n'
                   f'[broker]\nurl = "sqlite:///{tmp_path / "b.db"}"\n')
    check = tangguh_process("-c", cfg, "config", "check")
    assert (check.returncode, check.stdout) == (0, f"ok: {cfg}\n"), check
    assert "not waiting for 1 thread(s) a handler module started: pusher" in check.stderr
    out = tangguh_process("-c", cfg, "enqueue", "noop")
    assert out.returncode == 0 and out.stdout.startswith("job_") and out.stdout.count("\n") == 1, out
    listing = tangguh_process("-c", cfg, "schedules", "--json")
    assert (listing.returncode, json.loads(listing.stdout)) == (0, []), listing


@pytest.mark.parametrize("argv", [["job"], ["batch"], ["retry"], ["discard"], ["cancel"], ["dlq", "show"],
                                  ["dlq", "replay"], ["dlq", "purge"]], ids=lambda a: "-".join(a))
def test_an_id_argument_no_job_can_have_is_a_usage_error(capsys, cfg_path, broker, argv):
    """A byte the shell passed that is no UTF-8 arrives as a lone surrogate: it reached the broker,
    which failed with an "internal error" (exit 1; for retry, discard and cancel "stopped after 0
    of 1", the code that says something may have been written). Now the parser refuses it."""
    code, out, err = tangguh(capsys, "-c", cfg_path, *argv, "job_\udcff")
    assert (code, out, err.count("\n")) == (2, "", 1), err
    assert "argument ID: job id must be a string" in err and "internal error" not in err


@pytest.mark.parametrize("dry", [False, True])
def test_a_cancel_reason_the_broker_refuses_is_refused_before_anything(capsys, cfg_path, broker, dry):
    """A --reason over 1,000 characters was refused inside the run ("stopped after 0 of 1", exit 1)
    and --dry-run said "would cancel 1 job(s)"."""
    job_id = broker.enqueue(NewJob("email", {}))
    code, out, err = tangguh(capsys, "-c", cfg_path, "cancel", job_id, "--reason", "r" * 1001,
                             *(["--dry-run"] if dry else []))
    assert (code, out, err.count("\n")) == (2, "", 1) and "cancel reason is 1001 characters long" in err, err
    assert broker.get(job_id).state == "queued"


def test_enqueue_then_job_shows_every_field(capsys, cfg_path, broker):
    job_id = enqueue(capsys, cfg_path, "email", '{"to": "a@b", "n": [1, 2]}', "--resource-id", "user:9",
                     "--idempotency-key", "welcome:9", "--priority", "5", "--trace-id", "trace-1",
                     "--max-attempts", "3", "--timeout", "12.5")
    job = broker.get(job_id)
    assert (job.payload, job.resource_id, job.idempotency_key, job.priority, job.trace_id, job.max_attempts,
            job.timeout) == ({"to": "a@b", "n": [1, 2]}, "user:9", "welcome:9", 5, "trace-1", 3, 12.5)
    # The same idempotency key while unfinished: the same job.
    assert enqueue(capsys, cfg_path, "email", "{}", "--idempotency-key", "welcome:9") == job_id

    code, out, _ = tangguh(capsys, "job", job_id, "-c", cfg_path)
    assert code == 0
    for text in (job_id, "email", "queued", "0 of 3", '"to": "a@b"', "user:9", "welcome:9", "trace-1", "history"):
        assert text in out

    code, out, _ = tangguh(capsys, "-c", cfg_path, "job", job_id, "--json")
    data = json.loads(out)
    assert data["id"] == job_id and data["history"] == [] and data["payload"] == {"to": "a@b", "n": [1, 2]}


def test_job_shows_history_of_attempts(capsys, cfg_path, broker):
    job_id = make_dead(broker, message="no such customer")
    code, out, _ = tangguh(capsys, "job", job_id, "-c", cfg_path)
    assert code == 0
    assert "dead (exception)" in out and "#1 dead" in out and "ValueError: no such customer" in out
    assert "pid=4242" in out and "Traceback" in out


def test_job_not_found_is_exit_1_one_line(capsys, cfg_path, broker):
    code, out, err = tangguh(capsys, "job", "job_nope", "-c", cfg_path)
    assert (code, out, err) == (1, "", "tangguh: error: job job_nope not found\n")


def test_enqueue_delay_queue_and_type_defaults_show_in_stats(capsys, cfg_path, broker):
    ready = enqueue(capsys, cfg_path, "email", "{}")
    enqueue(capsys, cfg_path, "email", "{}", "--delay", "3600")
    report = enqueue(capsys, cfg_path, "report", "{}")
    assert (broker.get(report).queue, broker.get(report).max_attempts) == ("bulk", 2)
    enqueue(capsys, cfg_path, "report", "{}", "--depends-on", ready)  # a callback: waiting, in bulk
    make_dead(broker)
    code, out, _ = tangguh(capsys, "stats", "-c", cfg_path)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["QUEUE", "READY", "SCHEDULED", "WAITING", "IN_FLIGHT", "DEAD", "DONE", "OLDEST_READY",
                                "PAUSED"]
    assert lines[1].split()[:7] == ["default", "1", "1", "0", "0", "1", "0"]
    assert lines[2].split()[:7] == ["bulk", "1", "0", "1", "0", "0", "0"]
    ready_at = broker.get(ready).run_at
    wait_for(lambda: broker.now() > ready_at + 0.3, message="the ready job to wait 0.3 s")
    code, out, _ = tangguh(capsys, "stats", "--json", "-c", cfg_path)
    data = json.loads(out)
    assert data["default"]["ready"] == 1 and data["default"]["scheduled"] == 1 and data["default"]["dead"] == 1
    assert data["bulk"]["ready"] == 1 and data["bulk"]["waiting"] == 1
    assert 0.3 <= data["default"]["oldest_ready_age"] < broker.now() - ready_at + 0.01


# -- the error contract: one line, the right exit code, nothing written ------------------

def _config(tmp_path, body):
    path = tmp_path / "bad.toml"
    path.write_text(textwrap.dedent(body))
    return str(path)


BAD_ENQUEUES = {
    "malformed JSON": (["--payload", "{not json"], 2, "payload: malformed JSON"),
    "non-object payload": (["--payload", "[1, 2]"], 2, "payload: expected a JSON object, got list"),
    "string payload": (["--payload", '"hi"'], 2, "payload: expected a JSON object, got string"),
    # json.loads keeps the last of a repeated key: the first value would be lost without a word.
    "a key given twice": (["--payload", '{"a": {"c": 1, "c": 2}}'], 2, "payload: malformed JSON: key 'c' given twice"),
    "unknown queue": (["--queue", "nope"], 2, "queue 'nope' is not one of the configured broker.queues"),
    "negative delay": (["--delay", "-5"], 2, "delay must be a number of seconds >= 0"),
    "non-numeric delay": (["--delay", "soon"], 2, "--delay: invalid float value"),
    "zero max attempts": (["--max-attempts", "0"], 2, "max_attempts must be a positive integer"),
    "negative timeout": (["--timeout", "-1"], 2, "timeout must be a positive number"),
    "payload nested 950 deep": (["--payload", '{"a":' * 950 + "1" + "}" * 950], 2,
                                "payload is nested more than 64 levels deep"),
    "payload too deep to parse": (["--payload", "[" * 100_000], 2, "payload: nested more than 64 levels deep"),
    "delay of 1e300 seconds": (["--delay", "1e300"], 2, "delay must be a number of seconds >= 0 and up to"),
    "priority past 32 bits": (["--priority", str(10**20)], 2, "priority must be an integer from -2147483647"),
    "max attempts past 32 bits": (["--max-attempts", str(2**31)], 2, "max_attempts must be a positive integer up to"),
    "timeout of 1e300 seconds": (["--timeout", "1e300"], 2, "timeout must be a positive number of seconds up to"),
    "8 KB idempotency key": (["--idempotency-key", "k" * 8192], 2, "idempotency_key is 8192 characters long"),
    "8 KB resource id": (["--resource-id", "r" * 8192], 2, "resource_id is 8192 characters long"),
    # An unset variable (`--idempotency-key "$KEY"`): every such job was the first one, the rest dropped.
    "empty idempotency key": (["--idempotency-key", " "], 2, "--idempotency-key needs a key"),
    # The same unset variable: the job went to the type's queue, or joined every job of resource ""
    # (one at a time under exclusive = true), which no --resource-id filter can find.
    "empty queue": (["--queue", ""], 2, "--queue needs a queue name"),
    "empty resource id": (["--resource-id", " "], 2, "--resource-id needs an id"),
}


@pytest.mark.parametrize("case", sorted(BAD_ENQUEUES))
def test_bad_enqueue_exits_with_one_line_and_writes_nothing(case, cfg_path, db_path):
    extra, code, message = BAD_ENQUEUES[case]
    result = tangguh_process("enqueue", "email", "-c", cfg_path, *extra)
    assert result.returncode == code, result.stderr
    assert result.stdout == ""
    assert result.stderr.startswith("tangguh: error: ") and result.stderr.count("\n") == 1, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
    assert not os.path.exists(db_path)  # the broker was never even opened


def test_a_bad_demo_option_is_one_line_exit_2():
    """The invoices demo's own parser printed its usage above the error: three lines."""
    result = tangguh_process("demo", "invoices", "--bogus")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr == "tangguh: error: demo invoices: unrecognized arguments: --bogus\n"


def test_unreadable_config_is_exit_2(tmp_path):
    folder = tmp_path / "conf.toml"
    folder.mkdir()  # a folder where the file should be: unreadable even for root
    for path, message in ((folder, "cannot read"), (tmp_path / "missing.toml", "no such config file")):
        result = tangguh_process("enqueue", "email", "--payload", "{}", "-c", path, cwd=tmp_path)
        assert result.returncode == 2
        assert result.stderr.startswith(f"tangguh: error: {path}: {message}")
        assert result.stderr.count("\n") == 1
    assert os.listdir(tmp_path) == ["conf.toml"]


def test_a_command_that_acts_without_any_config_file_refuses_and_creates_nothing(tmp_path):
    # Built-in defaults here meant a new ./tangguh.db wherever the operator stood: at 3 a.m. in
    # the wrong folder, an empty dead-letter queue shown and jobs enqueued that nothing reads.
    assert not os.path.exists("/etc/tangguh/config.toml"), "this test needs no system-wide config"
    for args in (["enqueue", "email", "--payload", "{}"], ["dlq", "list"], ["stats"], ["jobs"], ["run"],
                 ["db", "migrate"], ["web"]):
        result = tangguh_process(*args, cwd=tmp_path)
        assert result.returncode == 2, (args, result.stderr)
        assert result.stderr == ("tangguh: error: no config file (./tangguh.toml or /etc/tangguh/config.toml):"
                                 " pass -c PATH (`tangguh config init` writes one)\n"), (args, result.stderr)
    assert os.listdir(tmp_path) == []
    # Status still asks the default socket (a broken config must not hide a running supervisor).
    result = tangguh_process("status", cwd=tmp_path)
    assert result.returncode == 1 and "warning: no config file" in result.stderr, result.stderr
    # And the config commands say what the defaults are.
    result = tangguh_process("config", "show", cwd=tmp_path)
    assert result.returncode == 0 and "[broker]" in result.stdout, result.stderr
    assert os.listdir(tmp_path) == []


def test_unknown_broker_scheme_is_exit_2(tmp_path):
    path = _config(tmp_path, '[broker]\nurl = "ftp://example.com/jobs"\n')
    result = tangguh_process("enqueue", "email", "--payload", "{}", "-c", path)
    assert result.returncode == 2
    assert result.stderr.startswith("tangguh: error: broker.url: unknown broker scheme 'ftp'")
    assert result.stderr.count("\n") == 1


@pytest.mark.parametrize("where", ["read-only folder", "folder that is a file"])
def test_database_that_cannot_be_created_is_exit_1_naming_it(tmp_path, where):
    if where == "read-only folder":
        # /proc refuses new files even to root, unlike a chmod'ed folder.
        if not os.path.isdir("/proc/self"):
            pytest.skip("no /proc")
        db = f"/proc/tangguh-{uuid.uuid4().hex[:8]}.db"
        message = f"cannot open sqlite database {db}"
    else:
        (tmp_path / "afile").write_text("")
        db = str(tmp_path / "afile" / "db.sqlite")
        message = str(tmp_path / "afile")
    path = _config(tmp_path, f'[broker]\nurl = "sqlite:///{db}"\n')
    result = tangguh_process("enqueue", "email", "--payload", "{}", "-c", path)
    assert result.returncode == 1
    assert result.stderr.startswith("tangguh: error: ") and message in result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert not os.path.exists(db)


@pytest.mark.parametrize("argv,message", [
    ([], "the following arguments are required: COMMAND"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    (["dlq"], "dlq: the following arguments are required: COMMAND"),
    (["enqueue"], "enqueue: the following arguments are required: TYPE"),
    (["stats", "--bogus"], "unrecognized arguments: --bogus"),
])
def test_usage_errors_are_one_line_exit_2(capsys, argv, message):
    code, out, err = tangguh(capsys, *argv)
    assert code == 2 and out == ""
    assert err.startswith("tangguh: error: ") and err.count("\n") == 1 and message in err, err


def _leaf_commands():
    """Every command's words and the positional values it needs, walking the parser."""
    from supervisor.cli import build_parser

    def walk(parser, words):
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            needed = ["job_01J0000000000000000000000A" if a.dest.endswith("id") else "x" for a in parser._actions
                      if not a.option_strings and a.nargs is None]
            yield words, needed
            return
        for name, sub in subs[0].choices.items():
            yield from walk(sub, [*words, name])

    return [(words, needed) for words, needed in walk(build_parser(), []) if words != ["demo"]]


@pytest.mark.parametrize("words,needed", _leaf_commands(), ids=lambda v: " ".join(v) if v else "-")
def test_an_unrecognized_argument_names_its_command(capsys, words, needed):
    """argparse said `tangguh: error: unrecognized arguments: --bogus` for any of them: which
    command did not take it was left to guess."""
    code, out, err = tangguh(capsys, *words, *needed, "--bogus")
    assert (code, out, err) == (2, "", f"tangguh: error: {' '.join(words)}: unrecognized arguments: --bogus\n")


def test_config_flag_works_before_and_after_the_command(capsys, cfg_path, broker):
    job_id = enqueue(capsys, cfg_path)
    for argv in (["-c", cfg_path, "job", job_id], ["job", job_id, "--config", cfg_path],
                 ["-c", "/nonexistent.toml", "job", job_id, "-c", cfg_path]):
        assert tangguh(capsys, *argv)[0] == 0


# -- dead letters -----------------------------------------------------------------

def test_dlq_list_and_show(capsys, cfg_path, broker):
    first = make_dead(broker, "email", message="first failure")
    second = make_dead(broker, "report", message="second failure")
    code, out, _ = tangguh(capsys, "dlq", "list", "-c", cfg_path)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["ID", "TYPE", "QUEUE", "REASON"]
    assert [line.split()[0] for line in lines[1:]] == [second, first]  # most recently failed first
    assert "ValueError: second failure" in lines[1]

    code, out, _ = tangguh(capsys, "dlq", "list", "--type", "email", "--json", "-c", cfg_path)
    assert [j["id"] for j in json.loads(out)] == [first]
    code, out, _ = tangguh(capsys, "dlq", "list", "--limit", "1", "--json", "-c", cfg_path)
    assert [j["id"] for j in json.loads(out)] == [second]

    code, out, _ = tangguh(capsys, "dlq", "show", first, "-c", cfg_path)
    assert code == 0
    for text in ("reason:", "exception", "ValueError: first failure", "Traceback (most recent call last)",
                 "first_failure_at:", "last_failure_at:", "1 attempt(s)", "#1 dead", "pid=4242"):
        assert text in out, text
    code, out, _ = tangguh(capsys, "dlq", "show", first, "--json", "-c", cfg_path)
    data = json.loads(out)
    assert data["reason"] == "exception" and data["error"]["class"] == "ValueError"
    assert data["first_failure_at"] and data["last_failure_at"] and len(data["history"]) == 1


def test_dlq_show_of_a_live_or_unknown_job_is_one_line(capsys, cfg_path, broker):
    live = broker.enqueue(NewJob("email", {}))
    code, out, err = tangguh(capsys, "dlq", "show", live, "-c", cfg_path)
    assert (code, out, err) == (1, "", f"tangguh: error: job {live} is queued, not dead\n")
    code, _, err = tangguh(capsys, "dlq", "show", "job_nope", "-c", cfg_path)
    assert code == 1 and err == "tangguh: error: job job_nope not found\n"


def test_dlq_replay_ids_and_refuses_live_jobs_all_or_nothing(capsys, cfg_path, broker):
    dead1, dead2 = make_dead(broker), make_dead(broker)
    live = broker.enqueue(NewJob("email", {}))
    code, out, err = tangguh(capsys, "dlq", "replay", dead1, live, "-c", cfg_path)
    assert code in (1, 2) and out == "" and err.count("\n") == 1 and f"job {live} is queued, not dead" in err
    assert broker.get(dead1).state == "dead"  # nothing replayed

    code, out, _ = tangguh(capsys, "dlq", "replay", dead1, dead2, "-c", cfg_path)
    assert (code, out) == (0, "replayed 2 job(s)\n")
    for job_id in (dead1, dead2):
        job = broker.get(job_id)
        assert (job.state, job.attempt, len(job.history)) == ("queued", 0, 1)


def test_dlq_replay_all_by_type_with_rate(capsys, cfg_path, broker):
    emails = [make_dead(broker, "email") for _ in range(3)]
    report = make_dead(broker, "report")
    code, out, _ = tangguh(capsys, "dlq", "replay", "--all", "--type", "email", "--rate", "200", "-c", cfg_path)
    assert (code, out) == (0, "replayed 3 job(s)\n")
    assert [broker.get(i).state for i in emails] == ["queued"] * 3
    assert broker.get(report).state == "dead"
    code, out, _ = tangguh(capsys, "dlq", "replay", "--all", "-c", cfg_path)
    assert (code, out, broker.get(report).state) == (0, "replayed 1 job(s)\n", "queued")


@pytest.mark.parametrize("argv,message", [
    (["dlq", "replay"], "give job ids or --all"),
    (["dlq", "replay", "job_x", "--all"], "not both"),
    (["dlq", "replay", "job_x", "--type", "email"], "--type only goes with --all"),
    (["dlq", "replay", "--all", "--rate", "0"], "--rate must be a number of replays per second, at least 0.01"),
    (["dlq", "replay", "--all", "--rate", "1e-300"], "at least 0.01"),  # its pause overflowed the clock
    (["dlq", "purge", "--all"], "add --yes to confirm"),
    (["dlq", "purge", "--all", "--type", "email"], "add --yes to confirm"),
    (["dlq", "list", "--limit", "-1"], "--limit must be >= 0"),
    # An unset variable: it listed every dead job, as if they were all of the type meant.
    (["dlq", "list", "--type", ""], "type filter must be 1 to 255 characters"),
])
def test_dlq_usage_errors_change_nothing(capsys, cfg_path, broker, argv, message):
    dead = make_dead(broker)
    code, out, err = tangguh(capsys, *argv, "-c", cfg_path)
    assert code == 2 and out == "" and err.count("\n") == 1 and message in err, err
    assert broker.get(dead).state == "dead"


def test_dlq_purge_ids_and_all(capsys, cfg_path, broker):
    dead = [make_dead(broker, "email") for _ in range(3)]
    live = broker.enqueue(NewJob("email", {}))
    code, _, err = tangguh(capsys, "dlq", "purge", live, "-c", cfg_path)
    assert code in (1, 2) and "not dead" in err and broker.get(live) is not None

    code, out, _ = tangguh(capsys, "dlq", "purge", dead[0], "-c", cfg_path)
    assert (code, out, broker.get(dead[0])) == (0, "purged 1 job(s)\n", None)
    code, out, _ = tangguh(capsys, "dlq", "purge", "--all", "--yes", "-c", cfg_path)
    assert (code, out) == (0, "purged 2 job(s)\n")
    assert broker.dlq_list() == [] and broker.get(live).state == "queued"
    code, out, _ = tangguh(capsys, "dlq", "list", "-c", cfg_path)
    assert (code, out) == (0, "no dead jobs\n")


# -- db migrate ---------------------------------------------------------------------

def test_db_migrate_creates_the_database(capsys, cfg_path, db_path):
    code, out, _ = tangguh(capsys, "db", "migrate", "-c", cfg_path)
    assert code == 0 and out.startswith("migrated sqlite:///") and db_path in out
    with open_broker("sqlite:///" + db_path) as b:
        assert b.stats(["default"])["default"].ready == 0
    assert redact("postgresql://app:s3cret@db/x") == "postgresql://app:***@db/x"


# -- the daemon commands, without a daemon ----------------------------------------------

@pytest.mark.parametrize("command", ["status", "metrics"])
def test_no_supervisor_answering_is_one_line_exit_1(tmp_path, command):
    path = _config(tmp_path, '[supervisor]\nsocket = "nobody.sock"\n')
    result = tangguh_process(command, "-c", path)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.startswith(f"tangguh: error: no supervisor answering on {tmp_path / 'nobody.sock'}")
    assert result.stderr.count("\n") == 1


@pytest.fixture
def fake_supervisor(tmp_path):
    """A health socket answering like a supervisor: one JSON line in, one JSON line out."""
    pytest.importorskip("supervisor.health")
    path = str(tmp_path / "fake.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(8)
    requests = []
    replies = {"status": STATUS_REPLY, "metrics": {"ok": True, "text": "tangguh_jobs_total 3\n"}}

    def serve():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                data = b""
                while not data.endswith(b"\n"):
                    chunk = conn.recv(4096)
                    if not chunk:
                        break
                    data += chunk
                req = json.loads(data)
                requests.append(req)
                reply = replies.get(req.get("cmd"), {"ok": False, "error": f"unknown command {req.get('cmd')!r}"})
                conn.sendall(json.dumps(reply).encode() + b"\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    cfg = tmp_path / "fake.toml"
    cfg.write_text('[supervisor]\nsocket = "fake.sock"\n')
    yield str(cfg), requests
    server.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept() (close alone does not)
    server.close()
    thread.join(5)


def test_status_watch_redraws_from_the_socket(capsys, fake_supervisor, monkeypatch):
    from supervisor.cli import watch

    cfg, requests = fake_supervisor
    real_run = watch.run
    monkeypatch.setattr(watch, "run", lambda fetch, interval: real_run(fetch, interval, sleep=lambda s: None,
                                                                       frames=3))
    code, out, _ = tangguh(capsys, "status", "--watch", "-c", cfg)
    assert code == 0
    frames = out.split(watch.CLEAR)[1:]
    assert len(frames) == 3 and all("job_01JABCDEF" in f and "send_email" in f for f in frames)
    assert requests == [{"cmd": "status"}] * 3


def test_status_watch_json_writes_one_json_object_a_line(fake_supervisor):
    """Each sample was written after a clear-screen sequence: no line of it was JSON, for jq or
    any reader."""
    cfg, requests = fake_supervisor
    proc = subprocess.Popen([sys.executable, "-m", "supervisor.cli", "status", "--watch", "0.05", "--json", "-c", cfg],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        lines = [proc.stdout.readline() for _ in range(3)]
    finally:
        proc.terminate()
        proc.wait(10)
    assert [json.loads(line) for line in lines] == [STATUS_REPLY] * 3


def test_status_watch_with_stdout_closed_ends_as_status_does(fake_supervisor):
    """`tangguh status --watch >&-` sampled the socket forever, writing to nowhere: it answers as
    `status >&-` does (asked once, exit 0); a pipe whose reader is gone ends it quietly, 141."""
    cfg, requests = fake_supervisor
    for extra in ([], ["--json"]):
        done = subprocess.run([sys.executable, "-m", "supervisor.cli", "status", "--watch", "0.05", *extra, "-c", cfg],
                              capture_output=True, text=True, preexec_fn=lambda: os.close(1), timeout=20)
        assert (done.returncode, done.stdout, done.stderr) == (0, "", ""), extra
        read, write = os.pipe()
        os.close(read)
        try:
            done = subprocess.run([sys.executable, "-m", "supervisor.cli", "status", "--watch", "0.05", *extra,
                                   "-c", cfg], stdout=write, stderr=subprocess.PIPE, text=True, timeout=20)
        finally:
            os.close(write)
        assert (done.returncode, done.stderr) == (141, ""), extra


def test_schedules_imports_the_handlers_as_run_does(tmp_path):
    """`schedules` imported the handler files in its own process: what a module printed at import
    went into `--json`'s stdout, and a module that called os._exit ended the command, exit 0,
    nothing listed."""
    handlers = tmp_path / "handlers"
    handlers.mkdir()
    (handlers / "noisy.py").write_text("import supervisor\n\nprint('hello from noisy import')\n\n"
                                       "@supervisor.job('nightly', cron='0 3 * * *')\ndef nightly(ctx, payload):\n"
                                       "    pass\n")
    cfg = tmp_path / "t.toml"
    cfg.write_text(f'[supervisor]\nhandlers = "handlers"\n[broker]\nurl = "sqlite:///{tmp_path}/b.db"\n')
    done = tangguh_process("schedules", "--json", "-c", str(cfg))
    assert done.returncode == 0, done.stderr
    assert [s["name"] for s in json.loads(done.stdout)] == ["nightly"]
    assert "hello from noisy import" in done.stderr
    (handlers / "leaves.py").write_text("import os\n\nos._exit(0)\n")
    done = tangguh_process("schedules", "--json", "-c", str(cfg))
    assert done.returncode == 2 and "ended the process importing it" in done.stderr and done.stdout == ""


def test_status_and_metrics_ask_the_health_socket(capsys, fake_supervisor):
    cfg, requests = fake_supervisor
    code, out, _ = tangguh(capsys, "status", "-c", cfg)
    assert code == 0 and out.startswith("supervisor pid 4100") and "send_email" in out
    code, out, _ = tangguh(capsys, "status", "--json", "-c", cfg)
    assert code == 0 and json.loads(out) == STATUS_REPLY
    code, out, _ = tangguh(capsys, "metrics", "-c", cfg)
    assert (code, out) == (0, "tangguh_jobs_total 3\n")
    assert requests == [{"cmd": "status"}, {"cmd": "status"}, {"cmd": "metrics"}]


def test_a_refused_request_is_one_line_exit_1(capsys, fake_supervisor, monkeypatch):
    cfg, _ = fake_supervisor
    from supervisor import health

    real = health.request
    monkeypatch.setattr(health, "request", lambda path, obj, timeout=5.0: real(path, {"cmd": "nope"}, timeout))
    code, out, err = tangguh(capsys, "metrics", "-c", cfg)
    assert (code, out) == (1, "")
    assert err.startswith("tangguh: error: supervisor on ") and err.endswith("unknown command 'nope'\n")


def test_the_console_script_lists_every_command():
    script = os.path.join(os.path.dirname(sys.executable), "tangguh")
    if not os.path.exists(script):
        pytest.skip("the tangguh console script is not installed in this environment")
    result = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    for command in ("run", "enqueue", "status", "stats", "job", "dlq", "config", "db", "metrics", "demo"):
        assert command in result.stdout


# Recorded from a running supervisor ({"cmd": "status"}), then given a password and a busy worker.
STATUS_REPLY = {
    "ok": True,
    "pid": 4100,
    "started_at": 1_000_000.0,
    "generation": 2,
    "config": "/etc/tangguh/config.toml",
    "broker": "postgresql://app:hunter2@db.internal/jobs",
    "reload_error": None,
    "stopping": False,
    "broker_down": False,
    "target_workers": 2,
    "prefetched": 0,
    "pending_writes": 0,
    "handlers": ["add", "send_email"],
    "workers": [
        {"slot": 0, "pid": 4101, "state": "busy", "job_id": "job_01JABCDEF", "job_type": "send_email",
         "attempt": 2, "elapsed": 12.34, "rss_bytes": 48 * 1024 * 1024, "jobs_done": 120, "generation": 2,
         "progress": 0.42, "progress_note": "rows", "cancelling": False},
        {"slot": 1, "pid": 4102, "state": "idle", "job_id": None, "job_type": None, "attempt": None,
         "elapsed": None, "rss_bytes": 40 * 1024 * 1024, "jobs_done": 7, "generation": 2},
    ],
    "restarts": 3,
    "counters": {"jobs_done": 127, "jobs_failed": 4, "duplicates_suppressed": 1},
}


def test_render_status_of_a_recorded_reply():
    text = render_status(STATUS_REPLY, now=1_000_000.0 + 3725)
    lines = text.splitlines()
    assert lines[0] == "supervisor pid 4100  generation 2  up 1h02m (since 1970-01-12T13:46:40.000Z)"
    assert "config:  /etc/tangguh/config.toml" in lines
    assert "broker:  postgresql://app:***@db.internal/jobs" in lines  # no password on screen
    assert "hunter2" not in text and "RELOAD FAILED" not in text
    assert "state:   running, target workers 2, prefetched 0, pending writes 0" in lines
    assert "types:   add, send_email" in lines
    assert "workers: 2 (1 busy)  restarts: 3" in lines
    header = next(i for i, line in enumerate(lines) if line.startswith("SLOT"))
    assert lines[header].split() == ["SLOT", "PID", "STATE", "JOB", "TYPE", "ATTEMPT", "ELAPSED", "PROGRESS", "RSS",
                                     "DONE", "GEN"]
    assert lines[header + 1].split() == ["0", "4101", "busy", "job_01JABCDEF", "send_email", "2", "12.3s", "42%",
                                         "rows", "48.0MiB", "120", "2"]
    assert lines[header + 2].split() == ["1", "4102", "idle", "-", "-", "-", "-", "-", "40.0MiB", "7", "2"]
    assert not any(line.startswith("paused:") for line in lines)
    assert lines[-1] == "counters: duplicates_suppressed=1  jobs_done=127  jobs_failed=4"


def test_render_status_shows_a_failed_reload_and_tolerates_missing_fields():
    reply = dict(STATUS_REPLY, reload_error="handlers/bad.py: SyntaxError: invalid syntax (line 3)", workers=[],
                 counters={})
    text = render_status(reply, now=1_000_000.0)
    assert "RELOAD FAILED (running the previous generation): handlers/bad.py: SyntaxError" in text
    assert "workers: 0 (0 busy)" in text and "SLOT" not in text
    text = render_status(dict(STATUS_REPLY, stopping=True, broker_down=True), now=1_000_000.0)
    assert "state:   stopping, BROKER DOWN" in text
    assert render_status({"pid": 1}).startswith("supervisor pid 1  generation -")
    text = render_status(dict(STATUS_REPLY, paused_queues=["bulk", "email"]), now=1_000_000.0)
    assert "paused:  bulk, email (not claimed from)" in text.splitlines()


def test_the_cli_waits_longer_than_two_default_broker_timeouts_for_an_answer():
    # In the turn a broker outage begins the master's loop may wait out two calls (an outcome
    # write's, then the claim's) before it reads the status request: 2 x 10 s on PostgreSQL's
    # default. The CLI waited 15 s and reported no supervisor answering.
    from supervisor.backends.postgres.connection import DEFAULT_SOCKET_TIMEOUT
    from supervisor.backends.redis.connection import _defaults
    from supervisor.cli.daemon import ANSWER_SECONDS

    assert ANSWER_SECONDS > 2 * max(float(DEFAULT_SOCKET_TIMEOUT), _defaults()["socket_timeout"])
