"""PostgreSQL-specific behaviour beyond the shared contract: the transactional
outbox, LISTEN/NOTIFY wake-ups, migrations, URL handling, reconnects, pruning."""
import os
import select
import threading
import urllib.parse

import psycopg
import pytest

from supervisor import toolkit
from supervisor.backends import open_broker
from supervisor.backends.postgres import schema as pg_schema
from supervisor.errors import BrokerError, ConfigError
from supervisor.model import NewJob, TypeLimits

from .daemon import Daemon, tangguh
from .util import wait_for

pytestmark = pytest.mark.services

Q = ["default"]
# Every schema version, as rows of the version table after a full migrate.
VERSIONS = [(version,) for version, _ in pg_schema.migrations('"s"')]


def new(payload=None, **kw):
    return NewJob("t", {"n": 1} if payload is None else payload, **kw)


def backend_gone(conn, pid):
    gone = conn.execute("SELECT NOT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = %s)", (pid,)).fetchone()[0]
    conn.commit()  # statistics are a snapshot per transaction
    return gone


def readable(fd):
    return bool(select.select([fd], [], [], 0)[0])


@pytest.fixture
def pg(postgres_url):
    from supervisor.backends.postgres import PostgresBroker

    b = PostgresBroker(postgres_url)
    b.migrate()
    yield b
    b.close()


@pytest.fixture
def other(pg, postgres_url):
    """A second broker instance on the same schema (another process's view)."""
    b = open_broker(postgres_url)
    yield b
    b.close()


@pytest.fixture
def producer(pg):
    """The application's own connection, in a transaction (not autocommit)."""
    conn = psycopg.connect(pg.conninfo)
    yield conn
    conn.close()


# -- transactional outbox -------------------------------------------------------

def test_outbox_job_exists_once_the_producer_commits(pg, other, producer):
    fd = other.wakeup_fd()
    producer.execute("CREATE TEMP TABLE orders (id int)")
    producer.execute("INSERT INTO orders VALUES (1)")
    job_id = pg.enqueue(new(idempotency_key="order:1"), conn=producer)
    assert producer.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
    assert pg.get(job_id) is None  # invisible until the producer commits
    assert other.claim(Q, 1, 30, "w") == []
    # Inside the producer's transaction the dedup already sees it.
    assert pg.enqueue(new(idempotency_key="order:1"), conn=producer) == job_id
    assert not readable(fd) or not other.drain_wakeups()  # NOTIFY is delivered only at commit
    producer.commit()
    wait_for(lambda: readable(fd), timeout=10, message="wake-up after the producer's commit")
    assert other.drain_wakeups() == {"default"}
    assert pg.get(job_id).state == "queued"
    assert other.claim(Q, 5, 30, "w")[0].id == job_id


def test_outbox_job_vanishes_when_the_producer_rolls_back(pg, producer):
    job_id = pg.enqueue(new(), conn=producer)
    ids = pg.enqueue_many([new(payload={"i": i}) for i in range(3)], conn=producer)
    producer.rollback()
    assert pg.get(job_id) is None and all(pg.get(i) is None for i in ids)
    assert pg.stats(Q)["default"].ready == 0
    assert pg.claim(Q, 10, 30, "w") == []


# -- wake-ups -------------------------------------------------------------------

def test_wakeup_fd_turns_readable_after_an_enqueue_elsewhere(pg, other):
    fd = pg.wakeup_fd()
    assert pg.wakeup_fd() == fd  # one listening connection, opened lazily
    assert not readable(fd)
    other.enqueue(new(queue="mail"))
    wait_for(lambda: readable(fd), timeout=10, message="wake-up fd to turn readable")
    assert pg.drain_wakeups() == {"mail"}
    assert not readable(fd)
    assert pg.drain_wakeups() == set()  # never blocks

    # A release (job due again) wakes it too; a delayed enqueue does not.
    other.enqueue(new(delay=60))
    job = other.enqueue(new())
    wait_for(lambda: readable(fd), timeout=10, message="wake-up after enqueue")
    pg.drain_wakeups()
    lease = other.claim(Q, 1, 30, "w")[0].lease
    assert lease.job_id == job
    other.release(lease)
    wait_for(lambda: readable(fd), timeout=10, message="wake-up after release")
    assert pg.drain_wakeups() == {"default"}


def test_broker_without_listener_drains_nothing(pg):
    assert pg.drain_wakeups() == set()


# -- migrations -----------------------------------------------------------------

def test_migrate_twice_keeps_one_version_row(pg, producer):
    pg.migrate()
    pg.migrate()
    rows = producer.execute(f'SELECT version FROM "{pg.schema}".tangguh_schema_version ORDER BY version').fetchall()
    assert rows == VERSIONS


def test_a_schema_a_newer_release_migrated_is_used_with_a_warning(pg, producer, caplog):
    """A rolling upgrade: the first upgraded supervisor migrates the schema. One not upgraded yet
    migrates again at its next reconnect (any broker hiccup) and refused the newer version
    ("upgrade tangguh"): it stopped claiming until upgraded. It goes on now, saying so."""
    producer.execute(f'INSERT INTO "{pg.schema}".tangguh_schema_version (version) VALUES (%s)',
                     (VERSIONS[-1][0] + 1,))
    producer.commit()
    with caplog.at_level("WARNING", logger="tangguh.broker"):
        pg.migrate()
    assert "newer than this tangguh knows" in caplog.text
    job_id = pg.enqueue(new())
    assert [job.id for job in pg.claim(Q, 1, 30, "me")] == [job_id]


@pytest.fixture
def app_role(pg):
    """A role with what an operator gives the application once the owner has migrated:
    USAGE on the schema, DML on its tables, EXECUTE on its functions; no CREATE."""
    import uuid

    role = f"tangguh_app_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg.conninfo, autocommit=True) as admin:
        admin.execute(f'CREATE ROLE "{role}" LOGIN')
        for grant in (f'USAGE ON SCHEMA "{pg.schema}"', f'SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA'
                      f' "{pg.schema}"', f'EXECUTE ON ALL FUNCTIONS IN SCHEMA "{pg.schema}"'):
            admin.execute(f'GRANT {grant} TO "{role}"')
    yield role
    with psycopg.connect(pg.conninfo, autocommit=True) as admin:
        admin.execute(f'DROP OWNED BY "{role}"')
        admin.execute(f'DROP ROLE "{role}"')


def test_an_up_to_date_schema_migrates_as_a_role_without_create_and_a_needed_one_says_so(pg, postgres_url, app_role):
    """Every supervisor migrates at start (``broker.migrate = true``). A schema at the last version
    needs nothing, so a least-privilege role must pass: ``CREATE TABLE IF NOT EXISTS`` asked for
    the CREATE privilege even when the table existed, and the daemon looped "broker unreachable".
    A schema that does need a migration names what is missing instead."""
    parts = urllib.parse.urlsplit(postgres_url)
    url = urllib.parse.urlunsplit(parts._replace(netloc=f"{app_role}@{parts.hostname}:{parts.port or 5432}"))
    app = open_broker(url)
    try:
        app.migrate()  # a no-op, allowed
        job_id = app.enqueue(new())
        assert [j.id for j in app.claim(Q, 1, 30, "w")] == [job_id]
        with psycopg.connect(pg.conninfo, autocommit=True) as admin:
            admin.execute(f'DELETE FROM "{pg.schema}".tangguh_schema_version WHERE version = %s', (VERSIONS[-1][0],))
        with pytest.raises(ConfigError, match=f"needs migrating to version {VERSIONS[-1][0]}.*tangguh db migrate"):
            app.migrate()
    finally:
        app.close()


def test_a_version_1_schema_is_upgraded_in_place(postgres_url, monkeypatch):
    from supervisor.backends import postgres
    from supervisor.model import TypeLimits

    every = postgres._migrations
    monkeypatch.setattr(postgres, "_migrations", lambda s: every(s)[:1])
    old = open_broker(postgres_url)
    old.migrate()
    # Written as a version-1 tangguh wrote it (today's enqueue names columns added since).
    kept = "job_v1"
    old._execute(f"INSERT INTO {old._jobs} (id, queue, type, payload, state, max_attempts, run_at, queued_at)"
                 " VALUES (%s, 'default', 'a', '{}', 'queued', 5, 0, 0)", (kept,))
    old.close()
    monkeypatch.setattr(postgres, "_migrations", every)
    b = open_broker(postgres_url)
    try:
        b.migrate()
        rows = b._execute(f'SELECT version FROM "{b.schema}".tangguh_schema_version ORDER BY version').fetchall()
        assert rows == VERSIONS
        assert [j.id for j in b.search({"payload": {}, "type": "a"}).jobs] == [kept]  # version 3's indexes
        assert [j.id for j in b.claim(Q, 5, 30, "w", limits={"a": TypeLimits(max_concurrency=1)})] == [kept]
        queued = b.enqueue(NewJob("a", {}))  # the job-control columns and states joined the old table
        assert b.cancel([queued, kept], "ops", None) == {queued: "cancelled", kept: "requested"}
    finally:
        b.close()


def _tables(conn, schema):
    return sorted(r[0] for r in conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = %s", (schema,)))


@pytest.fixture
def app_schema(postgres_url):
    """The broker URL's schema, made first by an application: its own schema_version and jobs."""
    schema = urllib.parse.parse_qs(urllib.parse.urlsplit(postgres_url).query)["schema"][0]
    with psycopg.connect(postgres_url.partition("?")[0], autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
        conn.execute(f'CREATE TABLE "{schema}".schema_version (version integer PRIMARY KEY, applied_at timestamptz)')
        conn.execute(f'INSERT INTO "{schema}".schema_version VALUES (7, now())')
    return schema


def test_migrate_refuses_a_schema_whose_schema_version_is_not_tangguhs(postgres_url, app_schema):
    b = open_broker(postgres_url)
    try:
        with pytest.raises(ConfigError, match=f"schema '{app_schema}' holds tables that are not Tangguh's"
                                              r" \(schema_version\)"):
            b.migrate()
    finally:
        b.close()
    with psycopg.connect(postgres_url.partition("?")[0], autocommit=True) as conn:
        assert _tables(conn, app_schema) == ["schema_version"]  # nothing created, nothing written
        assert conn.execute(f'SELECT version FROM "{app_schema}".schema_version').fetchall() == [(7,)]


def test_db_migrate_and_run_exit_2_on_a_schema_that_is_not_tangguhs(postgres_url, app_schema, tmp_path):
    d = Daemon(tmp_path, broker_url=postgres_url)
    result = tangguh("db", "migrate", "-c", d.config_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "holds tables that are not Tangguh's" in result.stderr
    # config check said ok and run then exited 2: it must say the same line (docs/operating.md), writing nothing.
    check = tangguh("config", "check", "-c", d.config_path)
    assert (check.returncode, check.stdout, check.stderr) == (2, "", result.stderr)
    with psycopg.connect(postgres_url.partition("?")[0], autocommit=True) as conn:
        assert _tables(conn, app_schema) == ["schema_version"]
    d.start(wait=False)
    try:
        assert d.wait_exit(timeout=30) == 2
        assert "holds tables that are not Tangguh's" in d.logs()
    finally:
        d.stop()


def test_a_schema_tangguh_made_under_the_old_version_table_name_is_adopted(pg, producer):
    kept = pg.enqueue(new())
    producer.execute(f'ALTER TABLE "{pg.schema}".tangguh_schema_version RENAME TO schema_version')
    producer.commit()
    pg.migrate()
    assert _tables(producer, pg.schema) == ["job_edges", "jobs", "once_keys", "paused_queues", "rate_buckets",
                                            "schedule_ticks", "supervisors", "tangguh_schema_version"]
    assert producer.execute(f'SELECT version FROM "{pg.schema}".tangguh_schema_version ORDER BY version'
                            ).fetchall() == VERSIONS
    assert [j.id for j in pg.claim(Q, 5, 30, "w")] == [kept]


def test_migrate_refuses_a_jobs_table_that_is_not_tangguhs(postgres_url, app_schema):
    with psycopg.connect(postgres_url.partition("?")[0], autocommit=True) as conn:
        conn.execute(f'CREATE TABLE "{app_schema}".jobs (id serial PRIMARY KEY, name text)')
    with open_broker(postgres_url) as b, pytest.raises(ConfigError, match=r"\(jobs, schema_version\)"):
        b.migrate()


def test_concurrent_migrations_do_not_collide(postgres_url):
    brokers = [open_broker(postgres_url) for _ in range(4)]
    barrier = threading.Barrier(len(brokers))
    errors = []

    def run(b):
        barrier.wait()
        try:
            b.migrate()
        except Exception as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(b,)) for b in brokers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        assert errors == []
        with psycopg.connect(brokers[0].conninfo) as conn:
            assert conn.execute(f'SELECT count(*) FROM "{brokers[0].schema}".tangguh_schema_version').fetchone()[0] == len(VERSIONS)
        assert brokers[0].get(brokers[1].enqueue(new())).state == "queued"
    finally:
        for b in brokers:
            b.close()


def test_unmigrated_schema_is_a_broker_error_naming_migrate(postgres_url):
    b = open_broker(postgres_url)
    try:
        with pytest.raises(BrokerError, match="migrate"):
            b.enqueue(new())
    finally:
        b.close()


# -- URLs and connections -----------------------------------------------------------

def test_unknown_url_option_is_a_broker_error(postgres_url):
    with pytest.raises(BrokerError, match="bogus"):
        open_broker(postgres_url + "&bogus=1")


@pytest.mark.parametrize("schema", ["", "has space", "x;drop", "a" * 64])
def test_bad_schema_name_is_a_broker_error(schema):
    with pytest.raises(BrokerError, match="schema"):
        open_broker(f"postgresql://postgres@127.0.0.1:5432/test?schema={schema}")


def test_libpq_options_pass_through_and_postgres_scheme_works(postgres_url):
    url = postgres_url.replace("postgresql://", "postgres://", 1) + "&application_name=tangguh-test&connect_timeout=5"
    b = open_broker(url)
    try:
        assert "schema=" not in b.conninfo
        assert b._conn().execute("SELECT current_setting('application_name')").fetchone()[0] == "tangguh-test"
    finally:
        b.close()


def test_connection_refused_is_a_broker_error():
    with pytest.raises(BrokerError):
        open_broker("postgresql://postgres@127.0.0.1:1/test?connect_timeout=5")


def test_lost_connection_is_a_broker_error_then_reconnects(pg, producer):
    job_id = pg.enqueue(new())
    pid = pg._conn().info.backend_pid
    producer.execute("SELECT pg_terminate_backend(%s)", (pid,))
    producer.commit()
    wait_for(lambda: backend_gone(producer, pid), timeout=10, message="the broker's backend to exit")
    with pytest.raises(BrokerError):
        pg.get(job_id)
    assert pg.get(job_id).state == "queued"  # the next call reconnects


def test_now_is_the_servers_clock(pg, producer):
    server = producer.execute("SELECT date_part('epoch', clock_timestamp())").fetchone()[0]
    assert abs(pg.now() - server) < 1.0


# -- producing details and pruning -----------------------------------------------------

def test_enqueue_of_the_same_new_job_twice_stores_it_once(pg):
    job = new()
    first = pg.enqueue(job)
    assert pg.enqueue(job) == first
    assert pg.enqueue_many([new(idempotency_key="k"), new(idempotency_key="k")]) == [
        pg.enqueue(new(idempotency_key="k"))] * 2
    assert pg.stats(Q)["default"].ready == 2


def test_prune_deletes_in_batches(pg, monkeypatch):
    pg.enqueue_many([new(payload={"i": i}) for i in range(10)])
    keep = pg.enqueue(new(delay=60))
    for job in pg.claim(Q, 10, 30, "w"):
        pg.ack(job.lease)
    wait_for(lambda: pg.now() > max(j.finished_at for j in pg_done(pg)) + 0.05, message="clock to pass")
    deletes = []
    real = pg._execute

    def spy(query, params=None, **kw):
        cur = real(query, params, **kw)
        if query.startswith("DELETE") and "'done'" in query:  # done jobs (cancelled/expired: a query apart)
            deletes.append(cur.rowcount)
        return cur

    monkeypatch.setattr(pg, "_execute", spy)
    # A budget under the batch size shrinks the batch: the master's loop turn deletes what it asked for.
    assert pg.prune(0, budget=4) == 4 and deletes == [4]
    pg.prune_batch = 3
    deletes.clear()
    assert pg.prune(0) == 6
    assert deletes == [3, 3, 0]
    assert pg.stats(Q)["default"].done == 0 and pg.get(keep) is not None


def pg_done(pg):
    rows = pg._execute(f"SELECT id FROM {pg._jobs} WHERE state = 'done'").fetchall()
    return [pg.get(r[0]) for r in rows]


def test_waits_one_after_another_listen_on_one_connection_and_a_lost_one_is_replaced(pg, producer):
    job_id = pg.enqueue(new())
    assert pg.wait(job_id, 0.01) is None
    kept = pg._connections.waiter
    assert kept is not None and not kept.closed
    assert pg.wait(job_id, 0.01) is None
    assert pg._connections.waiter is kept, "the second wait opened a connection of its own"
    # The server ends the kept connection meanwhile (a restart, idle_session_timeout): the
    # next wait listens on a new one instead of failing.
    pid = kept.info.backend_pid
    producer.execute("SELECT pg_terminate_backend(%s)", (pid,))
    producer.commit()
    wait_for(lambda: backend_gone(producer, pid), timeout=10, message="the kept connection's end")
    assert pg.wait(job_id, 0.01) is None
    assert pg._connections.waiter is not kept and pg._connections.waiter.info.backend_pid != pid


def test_lost_listener_is_a_broker_error_then_listens_again(pg, other, producer):
    fd = pg.wakeup_fd()
    pid = pg._listener.info.backend_pid
    producer.execute("SELECT pg_terminate_backend(%s)", (pid,))
    producer.commit()

    def drain_fails():
        # The server's goodbye and the EOF may arrive apart: each turns the socket readable.
        if not readable(fd):
            return False
        try:
            pg.drain_wakeups()
        except BrokerError:
            return True
        return False

    wait_for(drain_fails, timeout=10, message="drain_wakeups to report the lost listener")
    fd = pg.wakeup_fd()
    other.enqueue(new())
    wait_for(lambda: readable(fd), timeout=10, message="wake-up on the new listener")
    assert pg.drain_wakeups() == {"default"}


def test_a_supervisor_is_not_woken_by_enqueues_to_queues_it_does_not_serve(postgres_url, tmp_path):
    """Every supervisor of a schema LISTENs on one channel, each notification naming its queue.
    The master woke at each and claimed: a supervisor serving "a" made one empty claim per job
    enqueued to "b" (with N supervisors on their own queues, N claims per job enqueued)."""
    d = Daemon(tmp_path, broker_url=postgres_url, supervisor={"poll_interval": 30.0},
               broker={"queues": ["a"]}).start()
    try:
        broker = d.broker
        before = d.status()["empty_polls"]
        for n in range(50):
            broker.enqueue(new({"n": n}, queue="b"))
        # Notified after the 50 on one channel, so read after them: its job done, they were all seen.
        last = broker.enqueue(NewJob("noop", {}, queue="a"))
        wait_for(lambda: broker.get(last).state == "done", timeout=30, message="the job of queue a to run")
        # Woken by each, it made 50 empty claims or more. Without them, the idle backoff's own
        # (5 ms doubling up to poll_interval, from the start and again after the job of "a") make
        # about a dozen in the seconds a loaded machine takes here: not a fixed few.
        assert d.status()["empty_polls"] - before < 25
    finally:
        d.stop()


def test_concurrent_enqueues_with_one_key_store_one_job(pg, postgres_url):
    brokers = [open_broker(postgres_url) for _ in range(4)]
    barrier = threading.Barrier(len(brokers))
    results, errors = [], []

    def run(b):
        barrier.wait()
        try:
            for _ in range(25):
                results.append(b.enqueue(new(idempotency_key="only-once")))
        except Exception as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(b,)) for b in brokers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for b in brokers:
        b.close()
    assert errors == []
    assert len(results) == 100 and len(set(results)) == 1
    assert pg.stats(Q)["default"].ready == 1


def test_a_forked_child_opens_its_own_connection_and_leaves_the_parents_alone(pg):
    import os

    fd = pg.wakeup_fd()
    parent_pid = pg._conn().info.backend_pid
    child = os.fork()
    if child == 0:  # the child: use the inherited broker, then close it
        code = 1
        try:
            job_id = pg.enqueue(new(queue="from-child"))
            ok = pg._conn().info.backend_pid != parent_pid and pg.get(job_id) is not None
            pg.close()
            code = 0 if ok else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert pg._conn().info.backend_pid == parent_pid  # the parent's session survived
    assert pg.stats(["from-child"])["from-child"].ready == 1
    wait_for(lambda: readable(fd), timeout=10, message="the parent's listener to hear the child's enqueue")
    assert pg.drain_wakeups() == {"from-child"}


# -- every libpq URL form connects -------------------------------------------------

SOCKET_DIR = "/var/run/postgresql"
URL_FORMS = {
    # postgresql:///db has no host: libpq's Unix socket (its built-in directory, or ?host=).
    "no host": "postgresql:///test?user=postgres",
    "no host, socket dir in the query": f"postgresql:///test?host={SOCKET_DIR}&user=postgres",
    "socket dir as a percent-encoded host": "postgresql://postgres@%2Fvar%2Frun%2Fpostgresql/test",
    "host list": "postgresql://postgres@127.0.0.1,127.0.0.1:5432/test",
    "percent-encoded password": "postgresql://postgres:p%40ss%2Fw%3Ard%3F@127.0.0.1:5432/test",
}


def _schema_of(url):
    return urllib.parse.parse_qs(urllib.parse.urlsplit(url).query)["schema"][0]


def _with_schema(url, schema):
    return url + ("&" if "?" in url else "?") + f"schema={schema}"


@pytest.mark.parametrize("form", sorted(URL_FORMS))
def test_every_libpq_url_form_connects(postgres_url, form):
    if "socket" in form or form == "no host":
        if not os.path.exists(os.path.join(SOCKET_DIR, ".s.PGSQL.5432")):
            pytest.skip(f"no PostgreSQL socket in {SOCKET_DIR}")
    url = _with_schema(URL_FORMS[form], _schema_of(postgres_url))
    b = open_broker(url)
    try:
        b.migrate()
        job_id = b.enqueue(new())
        assert [j.id for j in b.claim(Q, 1, 30, "w")] == [job_id]
        assert b.wakeup_fd() >= 0
        info = b._conn().info
        if form == "percent-encoded password":
            assert info.password == "p@ss/w:rd?"
        if "socket" in form or form == "no host":
            assert info.host == SOCKET_DIR
        if form == "host list":
            assert info.host == "127.0.0.1"
    finally:
        b.close()
    toolkit_db = toolkit.Database(url)
    try:
        conn, kind = toolkit_db.connection()
        assert kind == "postgres"
        assert conn.execute("SELECT current_setting('search_path')").fetchone()[0] == _schema_of(postgres_url)
    finally:
        toolkit_db.close()


def test_a_url_libpq_cannot_read_is_a_broker_error_without_its_password():
    with pytest.raises(BrokerError, match="not a connection URL libpq can read") as err:
        open_broker("postgresql://postgres:s3cr%zzet@127.0.0.1:5432/test")  # a bad percent-escape
    assert "s3cr" not in str(err.value)


# -- lock order of the batched lease writes --------------------------------------------

class Concurrent:
    """Broker calls run in threads beside transactions a test holds: what each returned or
    raised (``results``), and whether a broker's session waits for a lock now."""

    def __init__(self, conninfo):
        self.watcher = psycopg.connect(conninfo, autocommit=True)
        self.results, self.threads = {}, []

    def start(self, name, fn):
        def run():
            try:
                self.results[name] = fn()
            except Exception as exc:  # noqa: BLE001 - the test reports it
                self.results[name] = exc
        thread = threading.Thread(target=run)
        thread.start()
        self.threads.append(thread)

    def waits(self, broker):
        return self.watcher.execute("SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = %s",
                                    (broker._conn().info.backend_pid,)).fetchone()[0]

    def wait_until_waiting(self, broker, what):
        wait_for(lambda: self.waits(broker), timeout=10, message=what)

    def join(self):
        for thread in self.threads:
            thread.join(30)


@pytest.fixture
def concurrent(pg):
    c = Concurrent(pg.conninfo)
    yield c
    c.join()
    c.watcher.close()


BATCHED_LEASE_WRITES = {
    "ack_many": lambda broker, leases: broker.ack_many([(lease, None, {}) for lease in leases]),
    "extend": lambda broker, leases: broker.extend(leases, 30),
    "renew": lambda broker, leases: broker.renew(leases, 30).lost,
}


def test_a_limited_claim_that_waited_for_another_claimers_lock_skips_a_queue_paused_meanwhile(pg, other, concurrent):
    """A claim under type limits waits for the limit's lock while another claimer holds it.
    It read the paused queues before that wait: a pause that committed meanwhile did not
    stop it, and it leased jobs of the paused queue (started inside the pause)."""
    from supervisor.model import TypeLimits

    pg.enqueue(new())
    holder = psycopg.connect(pg.conninfo)  # stands for another supervisor's limited claim, mid-way
    try:
        holder.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (f"tangguh-limit:{pg.schema}:t",))
        concurrent.start("claimed", lambda: pg.claim(Q, 5, 30, "w", limits={"t": TypeLimits(max_concurrency=5)}))
        concurrent.wait_until_waiting(pg, "the claim to wait for the limit's lock")
        other.pause("default", by="ops")
        holder.commit()
        concurrent.join()
    finally:
        holder.close()
    assert concurrent.results == {"claimed": []}
    other.resume("default")
    assert len(pg.claim(Q, 5, 30, "w", limits={"t": TypeLimits(max_concurrency=5)})) == 1


@pytest.mark.parametrize("write", sorted(BATCHED_LEASE_WRITES))
def test_a_batched_lease_write_locks_in_id_order_so_it_never_deadlocks_a_cancel(pg, concurrent, write):
    """A cancel (and every other multi-row write) locks jobs in id order. A batch of acks,
    extends or renewals that locked them in the order it was given (completion order, claim
    order) could hold B while waiting for A, and a cancel holding A then asking for B
    deadlocked it: PostgreSQL aborts one of the two after deadlock_timeout."""
    # Enough rows, analysed, for the plan a busy table gets: the batch's array outside,
    # the jobs looked up one by one (with two rows the planner scans the table instead).
    pg.enqueue_many([new({"n": n}) for n in range(1000)])
    a, b = sorted((job.lease for job in pg.claim(Q, 2, 30, "w")), key=lambda lease: lease.job_id)
    pg._execute(f"ANALYZE {pg._jobs}")
    canceller = psycopg.connect(pg.conninfo)  # stands for a cancel's transaction: A, then B
    # Were there a deadlock, the canceller would be the side PostgreSQL aborts (its
    # deadlock_timeout ends first): the batch's own abort would be run again unseen.
    canceller.execute("SET deadlock_timeout = '100ms'")
    pg._conn().execute("SET deadlock_timeout = '20s'")
    try:
        canceller.execute(f"SELECT id FROM {pg._jobs} WHERE id = %s FOR UPDATE", (a.job_id,))
        concurrent.start("lost", lambda: BATCHED_LEASE_WRITES[write](pg, [b, a]))  # not in id order
        concurrent.wait_until_waiting(pg, f"{write} to wait for the cancel's lock on the first job")
        canceller.execute(f"SELECT id FROM {pg._jobs} WHERE id = %s FOR UPDATE", (b.job_id,))
        canceller.commit()
        concurrent.join()
    finally:
        canceller.close()
    assert concurrent.results == {"lost": []}


@pytest.mark.parametrize("write", sorted(BATCHED_LEASE_WRITES))
def test_a_batched_lease_write_that_waited_for_a_renewal_still_finds_its_lease(pg, concurrent, write):
    """A renewal of the same job commits while the batch waits for its lock: the row has
    moved (a new version), and the batch must still see its current lease, not call it lost."""
    pg.enqueue_many([new({"n": 1}), new({"n": 2})])
    leases = [job.lease for job in pg.claim(Q, 2, 30, "w")]
    renewal = psycopg.connect(pg.conninfo)
    try:
        renewal.execute(f"UPDATE {pg._jobs} SET lease_until = lease_until + 5 WHERE id = %s", (leases[0].job_id,))
        concurrent.start("lost", lambda: BATCHED_LEASE_WRITES[write](pg, leases))
        concurrent.wait_until_waiting(pg, f"{write} to wait for the renewal's lock")
        renewal.commit()
        concurrent.join()
    finally:
        renewal.close()
    assert concurrent.results == {"lost": []}


# -- deadlocks PostgreSQL breaks by aborting one side ----------------------------------------

@pytest.mark.parametrize("victim", ["ack", "cancel"])
def test_a_write_postgresql_aborts_to_break_a_deadlock_runs_again(pg, postgres_url, concurrent, victim):
    """cancel([callback, member]) (what cancel_batch sends) locks ids in id order; the
    member's ack locks the member, then its trigger locks the callback (a child). With the
    callback's id first (same-millisecond ids: half the time) the two wait on each other
    and PostgreSQL aborts one: the side whose deadlock_timeout ends first, set here to
    choose it (a statement of its own, or a transaction of several). The aborted side was
    rolled back whole and runs again."""
    member, callback = "job_B_member", "job_A_callback"
    pg.enqueue_many([new({"n": 1}, id=member), new({"n": 2}, id=callback, depends_on=[(member, "complete")])])
    (job,) = pg.claim(Q, 1, 300, "w")
    assert job.id == member
    cancelling, acking = open_broker(postgres_url), open_broker(postgres_url)
    for broker, name in ((cancelling, "cancel"), (acking, "ack")):
        broker._conn().execute(f"SET deadlock_timeout = '{'100ms' if name == victim else '20s'}'")
    # Holds the member against the cancel's FOR UPDATE but not against the ack's UPDATE
    # (FOR KEY SHARE conflicts only with key changes): the cancel locks the callback, then waits.
    gate = psycopg.connect(pg.conninfo)
    try:
        gate.execute(f"SELECT id FROM {pg._jobs} WHERE id = %s FOR KEY SHARE", (member,))
        concurrent.start("cancel", lambda: cancelling.cancel([callback, member], "op", "x"))
        concurrent.wait_until_waiting(cancelling, "the cancel to hold the callback and wait")
        concurrent.start("ack", lambda: acking.ack(job.lease, {"r": 1}))
        concurrent.wait_until_waiting(acking, "the ack to hold the member and wait")
        gate.commit()
        concurrent.join()
    finally:
        gate.close()
        cancelling.close()
        acking.close()
    done = concurrent.results
    # Whichever side PostgreSQL aborted ran again: the ack stored, the cancel answered (the
    # member running, or already done when the cancel was the one that ran again).
    assert done["ack"] is None and done["cancel"][callback] == "cancelled", done
    assert done["cancel"][member] in ("requested", "already_done"), done
    assert (pg.get(member).state, pg.get(callback).state) == ("done", "cancelled")


def test_a_requeue_of_several_ids_whose_later_one_postgresql_aborts_runs_that_one_again(pg):
    """A requeue commits one job at a time. When PostgreSQL aborted a later job's transaction
    to break a deadlock, the whole call ran again: the jobs it had put back already were then
    queued, and it answered not_finished for them. (The abort is forced here by a trigger
    raising deadlock_detected once, counted by a sequence, which no rollback takes back.)"""
    pg.enqueue_many([new({"n": 1}, id="job_A"), new({"n": 2}, id="job_B")])
    for job in pg.claim(Q, 2, 30, "w"):
        pg.dead(job.lease, "failed", {"class": "E", "message": "m", "traceback": ""})
    _deadlock_once(pg, "NEW.id = 'job_B'")
    assert pg.requeue(["job_A", "job_B"]) == {"job_A": "queued", "job_B": "queued"}
    assert pg._execute(f"SELECT last_value FROM {pg.schema}.deadlock_once").fetchone()[0] >= 2  # B ran twice
    assert {pg.get("job_A").state, pg.get("job_B").state} == {"queued"}


def _deadlock_once(pg, when):
    """The first UPDATE of a job row matching ``when`` (SQL on NEW) aborts as a deadlock would;
    a sequence counts the tries (no rollback takes it back): ``deadlock_tries``."""
    pg._execute(f"CREATE SEQUENCE {pg.schema}.deadlock_once")
    pg._execute(f"""CREATE FUNCTION {pg.schema}.deadlock_once() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF {when} AND nextval('{pg.schema}.deadlock_once') = 1 THEN
                RAISE EXCEPTION 'deadlock detected (forced)' USING ERRCODE = 'deadlock_detected';
            END IF;
            RETURN NEW;
        END $$""")
    pg._execute(f"CREATE TRIGGER deadlock_once BEFORE UPDATE ON {pg._jobs}"
                f" FOR EACH ROW EXECUTE FUNCTION {pg.schema}.deadlock_once()")


def test_a_claim_under_limits_postgresql_aborts_to_break_a_deadlock_runs_again(pg):
    """The claim under per-type limits is a transaction of several statements (its first one
    reclaims expired leases, whose dead-lettering or cancel runs the workflow triggers: the
    locks an ack takes, the ones that deadlock a cancel). PostgreSQL aborting it failed the
    claim with BrokerError, which the supervisor reads as an outage ("broker unreachable,
    pausing claims") where the plain claim runs again. (The abort is forced here by a trigger
    raising deadlock_detected once, counted by a sequence, which no rollback takes back.)"""
    kept = pg.enqueue(new())
    _deadlock_once(pg, "NEW.state = 'running'")
    limits = {"t": TypeLimits(max_concurrency=2, rate=(5, 1.0), exclusive=True)}
    assert [job.id for job in pg.claim(Q, 5, 30, "w", limits=limits)] == [kept]
    assert pg._execute(f"SELECT last_value FROM {pg.schema}.deadlock_once").fetchone()[0] >= 2  # ran twice
    assert pg.get(kept).attempt == 1  # the aborted run left nothing behind
    assert pg._execute(f"SELECT tokens FROM {pg.schema}.rate_buckets").fetchall() == [(4.0,)]


@pytest.mark.parametrize("reopen", ["dlq_replay", "requeue"])
def test_a_child_reopened_while_another_parent_ends_is_still_released(pg, postgres_url, concurrent, reopen):
    """J waits on P1 (success) and P2 (complete); P1 dead-lettered, so J was cancelled.
    P2's ack has written its edges (J skipped: cancelled then) and not committed yet,
    while a replay (or requeue) of P1 reopens J: the reopen must wait for P2's end and
    count it, or J waits for P2 forever once P1 is done. (A replay locks its parents'
    children before it reopens them, _lock_children; a requeue, one job per transaction,
    relies on the trigger's own lock.)"""
    p1, p2, j, k = "job_P1", "job_P2", "job_J", "job_K"
    pg.enqueue_many([new({"n": 1}, id=p1, max_attempts=1), new({"n": 2}, id=p2),
                     new({"n": 3}, id=j, depends_on=[(p1, "success"), (p2, "complete")]),
                     new({"n": 4}, id=k, depends_on=[(p2, "complete")])])
    leases = {job.id: job.lease for job in pg.claim(Q, 2, 300, "w")}
    pg.dead(leases[p1], "failed", {"class": "E", "message": "m", "traceback": ""})
    assert pg.get(j).state == "cancelled"
    acking, replaying = open_broker(postgres_url), open_broker(postgres_url)
    # Holds K, P2's other child: P2's ack stops between its edges and its commit.
    gate = psycopg.connect(pg.conninfo)
    try:
        gate.execute(f"SELECT id FROM {pg._jobs} WHERE id = %s FOR UPDATE", (k,))
        concurrent.start("ack", lambda: acking.ack(leases[p2]))
        concurrent.wait_until_waiting(acking, "P2's ack to wait for K, its edges written")
        concurrent.start("replay", lambda: getattr(replaying, reopen)([p1]))
        # The fixed reopen waits for P2's edge; the broken one commits at once.
        wait_for(lambda: concurrent.waits(replaying) or "replay" in concurrent.results, timeout=10,
                 message="the replay to wait or end")
        gate.commit()
        concurrent.join()
    finally:
        gate.close()
        acking.close()
        replaying.close()
    answer = [p1] if reopen == "dlq_replay" else {p1: "queued"}
    assert concurrent.results == {"ack": None, "replay": answer}, concurrent.results
    again = {job.id: job.lease for job in pg.claim(Q, 5, 300, "w")}
    assert set(again) == {p1, k}  # K was released by P2's end; J waits for P1
    pg.ack(again[p1])  # P1 runs again and succeeds: J's last parent
    assert pg.get(j).state == "queued"


def crosswise(pg, postgres_url, concurrent, caplog, held, first_write, second_write):
    """Run ``first_write(broker)``, then ``second_write(broker)``, each on a session of its own,
    both queued behind a third session holding job ``held`` until both wait for it: the
    crosswise order, every run. Returns their results; a deadlock PostgreSQL broke (the write
    run again, seen only as the ``deadlock_retry`` warning) fails the test."""
    first, second = open_broker(postgres_url), open_broker(postgres_url)
    # The deadlock, were there one, is found at once by the second write, and it is the one run again.
    first._conn().execute("SET deadlock_timeout = '20s'")
    second._conn().execute("SET deadlock_timeout = '100ms'")
    gate = psycopg.connect(pg.conninfo)
    try:
        gate.execute(f"SELECT id FROM {pg._jobs} WHERE id = %s FOR UPDATE", (held,))
        with caplog.at_level("WARNING", logger="tangguh.broker"):
            concurrent.start("first", lambda: first_write(first))
            concurrent.wait_until_waiting(first, f"the first write to wait for {held}")
            concurrent.start("second", lambda: second_write(second))
            concurrent.wait_until_waiting(second, f"the second write to wait for {held}")
            gate.commit()
            concurrent.join()
    finally:
        gate.close()
        first.close()
        second.close()
    assert [r.getMessage() for r in caplog.records if getattr(r, "event", None) == "deadlock_retry"] == []
    return concurrent.results


@pytest.mark.parametrize("children", ["waiting", "cancelled"])
def test_two_ack_batches_ending_parents_of_the_same_children_crosswise_never_deadlock(pg, postgres_url, concurrent,
                                                                                     children, caplog):
    """Children A and B each wait on two parents. One supervisor's ack_many ends p_A and p_B,
    another's q_B and q_A (their ids in that order: a batch updates in id order). Each
    parent's end locks its children (waiting or cancelled, schema version 11), one parent
    after another: batch 1 took A then wanted B, batch 2 took B then wanted A, and
    PostgreSQL aborted one after deadlock_timeout (run again, unseen but for the warning).
    Each batch now locks all its children first, in id order. A gate holding A makes
    both batches reach A before either goes on: the crosswise order, every run."""
    a, b = "job_A", "job_B"
    p_a, p_b, q_b, q_a = "job_1p", "job_2p", "job_3q", "job_4q"
    failed = children == "cancelled"  # a third parent of each (on success) dead-lettered: A and B cancelled
    third = {x: [(f"job_0{x}", "success")] if failed else [] for x in "ab"}
    extra = [new({"n": 0}, id=f"job_0{x}", max_attempts=1) for x in "ab"] if failed else []
    pg.enqueue_many(extra + [new({"n": n}, id=job_id) for n, job_id in enumerate((p_a, p_b, q_b, q_a))] + [
        new({"n": 5}, id=a, depends_on=[(p_a, "complete"), (q_a, "complete")] + third["a"]),
        new({"n": 6}, id=b, depends_on=[(p_b, "complete"), (q_b, "complete")] + third["b"])])
    leases = {job.id: job.lease for job in pg.claim(Q, 10, 300, "w")}
    for x in "ab" if failed else "":
        pg.dead(leases[f"job_0{x}"], "failed", {"class": "E", "message": "m", "traceback": ""})
    assert {pg.get(a).state, pg.get(b).state} == {children}
    results = crosswise(pg, postgres_url, concurrent, caplog, a,
                        lambda broker: broker.ack_many([(leases[p_a], None, {}), (leases[p_b], None, {})]),
                        lambda broker: broker.ack_many([(leases[q_a], None, {}), (leases[q_b], None, {})]))
    assert results == {"first": [], "second": []}, results
    assert {job_id: pg.get(job_id).state for job_id in (p_a, p_b, q_b, q_a)} == dict.fromkeys(
        (p_a, p_b, q_b, q_a), "done")
    released = "cancelled" if failed else "queued"  # the last parent of each ended: released, or still cancelled
    assert (pg.get(a).state, pg.get(b).state) == (released, released)

# An operator's write of several parents: what it does to them, what it answers, and the state
# of each child once both writes committed (released, or reopened to wait for both parents).
CROSSWISE_OPERATOR_WRITES = {
    "cancel": (lambda broker, ids: broker.cancel(ids, "ops", "crosswise"), "cancelled", "queued"),
    "discard": (lambda broker, ids: broker.discard(ids), "discarded", "queued"),
    "dlq_replay": (lambda broker, ids: broker.dlq_replay(ids), None, "waiting"),
}


@pytest.mark.parametrize("write", sorted(CROSSWISE_OPERATOR_WRITES))
def test_two_operator_writes_ending_or_reopening_parents_of_the_same_children_crosswise_never_deadlock(
        pg, postgres_url, concurrent, write, caplog):
    """Children A and B each have two parents. One operator's cancel (discard, replay) names
    p_A and p_B, another's q_B and q_A (locked, then written, in id order). Each parent's end
    (flow_settle: a cancel, a discard of an unfinished job) or reopen (flow_reopen: a replay)
    locks its children, one parent after another: write 1 took A then wanted B, write 2 took
    B then wanted A, and PostgreSQL aborted one after deadlock_timeout (run again, unseen but
    for the warning). Each write now locks all its parents' children first, in id order
    (_lock_children). A gate holding A makes both writes reach A before either goes on."""
    run, answer, child_state = CROSSWISE_OPERATOR_WRITES[write]
    a, b = "job_A", "job_B"
    p_a, p_b, q_b, q_a = "job_1p", "job_2p", "job_3q", "job_4q"
    parents = (p_a, p_b, q_b, q_a)
    replay = write == "dlq_replay"
    on = "success" if replay else "complete"  # replayed: dead parents, children cancelled parent_failed
    pg.enqueue_many([new({"n": n}, id=job_id, max_attempts=1) for n, job_id in enumerate(parents)] + [
        new({"n": 5}, id=a, depends_on=[(p_a, on), (q_a, on)]),
        new({"n": 6}, id=b, depends_on=[(p_b, on), (q_b, on)])])
    if replay:
        for job in pg.claim(Q, 10, 300, "w"):
            pg.dead(job.lease, "failed", {"class": "E", "message": "m", "traceback": ""})
    assert {pg.get(a).state, pg.get(b).state} == {"cancelled" if replay else "waiting"}
    results = crosswise(pg, postgres_url, concurrent, caplog, a,
                        lambda broker: run(broker, [p_a, p_b]), lambda broker: run(broker, [q_b, q_a]))
    if answer is None:
        assert results == {"first": [p_a, p_b], "second": [q_b, q_a]}, results
    else:
        assert results == {"first": dict.fromkeys((p_a, p_b), answer),
                           "second": dict.fromkeys((q_b, q_a), answer)}, results
    stored = {"cancel": "cancelled", "discard": None, "dlq_replay": "queued"}[write]
    assert {job_id: getattr(pg.get(job_id), "state", None) for job_id in parents} == dict.fromkeys(parents, stored)
    assert (pg.get(a).state, pg.get(b).state) == (child_state, child_state)
    if replay:  # reopened once by each parent: waiting for both again
        assert (pg.get(a).pending, pg.get(b).pending) == (2, 2)


def test_two_cancels_whose_parents_end_in_separate_statements_crosswise_never_deadlock(pg, postgres_url, concurrent,
                                                                                       caplog):
    """A cancel ends its jobs in one statement, cut after a parent that comes before a job with
    parents of its own, and settles each statement's children after it (fanin.py), locking them
    there in id order. Cut, one cancel settles A then B in two statements, the other B then A:
    only the children of every parent locked first, in id order (_lock_children), keeps the two
    from deadlocking. A gate holding A makes both reach A before either goes on."""
    a, b = "job_A", "job_B"
    p_a, p_b, q_b, q_a = "job_1p", "job_2p", "job_3q", "job_4q"
    c_1, c_2, r = "job_5c", "job_6c", "job_0r"  # a job with a parent of its own in each call: the cut
    pg.enqueue_many([new({"n": n}, id=job_id) for n, job_id in enumerate((p_a, p_b, q_b, q_a, r))] + [
        new({"n": 5}, id=a, depends_on=[(p_a, "complete"), (q_a, "complete")]),
        new({"n": 6}, id=b, depends_on=[(p_b, "complete"), (q_b, "complete")]),
        new({"n": 7}, id=c_1, depends_on=[(r, "complete")]),
        new({"n": 8}, id=c_2, depends_on=[(r, "complete")])])

    def cancel(ids):
        return lambda broker: broker.cancel(ids, "ops", "crosswise")
    results = crosswise(pg, postgres_url, concurrent, caplog, a, cancel([p_a, c_1, p_b]), cancel([q_b, c_2, q_a]))
    assert results == {"first": dict.fromkeys((p_a, c_1, p_b), "cancelled"),
                       "second": dict.fromkeys((q_b, c_2, q_a), "cancelled")}, results
    assert (pg.get(a).state, pg.get(b).state) == ("queued", "queued")


def test_one_claim_ends_a_bounded_number_of_expired_jobs_and_the_next_ones_the_rest(pg, producer, monkeypatch):
    """A backlog of jobs past their ``expires_at`` (a long outage) was ended, and returned
    whole (payload, history), by the first claim alone: its time and memory grew with the
    backlog. Each claim now ends at most EXPIRE_BATCH of them."""
    from supervisor.backends.postgres.control_schema import EXPIRE_BATCH

    pg.enqueue_many([new({"pad": "x" * 100}, expires_in=0.001) for _ in range(EXPIRE_BATCH + 200)])
    wait_for(lambda: pg.now() > producer.execute(f'SELECT max(expires_at) FROM "{pg.schema}".jobs').fetchone()[0],
             message="every job past its expires_at")
    producer.rollback()

    def expired():
        n = producer.execute(f"SELECT count(*) FROM \"{pg.schema}\".jobs WHERE state = 'expired'").fetchone()[0]
        producer.rollback()
        return n

    assert pg.claim(Q, 1, 30, "w") == [] and expired() == EXPIRE_BATCH
    assert pg.claim(Q, 1, 30, "w") == [] and expired() == EXPIRE_BATCH + 200


def test_a_claim_reads_none_of_the_jobs_scheduled_for_later(pg, postgres_url):
    """In one ordered scan of jobs_ready (queue, priority DESC, run_at, id), the jobs
    scheduled for later, behind their priority's due ones but in front of every lower
    priority's, were read by every claim (100,000 jobs due tomorrow: 9 ms a claim, idle
    polls too). The claim function's work is counted in buffers (EXPLAIN ANALYZE BUFFERS
    counts those of the statements inside it), not in time."""
    def blocks_of_a_claim():
        with psycopg.connect(postgres_url.split("?")[0], autocommit=True) as conn:
            [[plan]] = conn.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) SELECT * FROM"
                                    f' "{pg.schema}".claim(ARRAY[\'default\'], 8, 30, \'me\')').fetchone()
        return plan["Plan"]["Shared Hit Blocks"] + plan["Plan"]["Shared Read Blocks"]

    pg.enqueue_many([new(delay=86400, priority=5) for _ in range(100)])
    few = blocks_of_a_claim()
    pg.enqueue_many([new(delay=86400, priority=5) for _ in range(20_000)])
    many = blocks_of_a_claim()
    assert many - few <= 30, (few, many)  # walking them: 240 blocks more
    # Due jobs behind them at lower priorities, and past the probes (more priorities than
    # PRIORITY_PROBES: the rest in one ordered scan), in claim order.
    pg.enqueue_many([new({"n": i}, priority=-i) for i in range(40)])
    assert [job.payload["n"] for job in pg.claim(["default"], 40, 30, "me")] == list(range(40))


def test_a_queue_sample_the_server_cannot_count_in_time_is_given_up_and_the_heartbeat_goes_on(pg, postgres_url,
                                                                                                caplog):
    """The heartbeat's queue sample is bounded (half of what a lease has left past a beat): a
    count held up (here by a lock; in production by millions of dead letters) is cancelled by
    the server, logged, and the next beat's renewals come in time."""
    from supervisor import heartbeat

    taken = []
    beat = heartbeat.Heartbeat(postgres_url, 1.2, 1.0, None, ["default"], on_sample=taken.append)
    with psycopg.connect(postgres_url.split("?")[0]) as locker:
        locker.execute(f"LOCK TABLE {pg._jobs} IN ACCESS EXCLUSIVE MODE")
        with caplog.at_level("WARNING", logger="tangguh.heartbeat"):
            beat.sample()  # within max(0.1, (1.2 - 1.0) / 2) = 0.1 s: cancelled, not raised
            beat.sample()  # a failed sample waits its turn too: not one count after another every beat
        # One try (an outage's later failures are logged at DEBUG, so the log cannot tell).
        assert taken == [] and beat.sample_failures == 1 and caplog.text.count("queue sample not taken") == 1
    beat.next_sample_at = 0.0
    beat.sample()
    assert [set(stats) for stats in taken] == [{"default"}]
    beat.close()


def test_a_failing_queue_sample_leaves_the_last_counts_marked_with_their_age(pg, postgres_url):
    """Status showed the last counts as if fresh while every later count was given up (a dead
    letter queue grown past what the broker counts in time): DEAD 0 beside 3 million dead jobs."""
    from supervisor import heartbeat
    from supervisor.master.status import sampled_ago

    beat = heartbeat.Heartbeat(postgres_url, 1.2, 1.0, None, ["default"], on_sample=lambda stats: None)
    assert sampled_ago(beat) is None and not beat.sample_failing
    beat.sample()
    assert beat.queue_stats["default"].dead == 0 and not beat.sample_failing
    taken_at = beat.sampled_at
    pg.enqueue(new())
    with psycopg.connect(postgres_url.split("?")[0]) as locker:
        locker.execute(f"LOCK TABLE {pg._jobs} IN ACCESS EXCLUSIVE MODE")
        beat.next_sample_at = 0.0
        beat.sample()  # given up after 0.1 s
    assert beat.sample_failing and beat.sampled_at == taken_at and beat.queue_stats["default"].ready == 0
    assert sampled_ago(beat) >= 0
    beat.next_sample_at = 0.0
    beat.sample()
    assert not beat.sample_failing and beat.queue_stats["default"].ready == 1 and beat.sampled_at > taken_at
    beat.close()


def test_a_wait_whose_listening_session_is_ended_reads_at_the_fallback_pace(pg, producer):
    """An idle reaper or a pooler ends the LISTEN session of a wait: it re-read the job as
    fast as the queries came back (4,000 a second, for the whole timeout)."""
    from supervisor.backends.postgres import control as pg_control

    job_id = pg.enqueue(new())
    reads = []
    pg.get = lambda job_id, get=pg.get: (reads.append(1), get(job_id))[1]
    waiting = threading.Thread(target=pg.wait, args=(job_id, 3.0))
    waiting.start()

    def listener_pid():
        row = producer.execute("SELECT pid FROM pg_stat_activity WHERE query LIKE %s",
                               (f'LISTEN "{pg_control.done_channel(pg.schema)}"%',)).fetchone()
        producer.commit()
        return row and row[0]
    pid = wait_for(listener_pid, timeout=10, message="the wait's LISTEN session")
    producer.execute("SELECT pg_terminate_backend(%s)", (pid,))
    producer.commit()
    waiting.join(30)
    assert not waiting.is_alive() and len(reads) <= 3 / pg_control.WAIT_FALLBACK + 3, len(reads)


def test_stopping_the_heartbeat_for_a_fork_interrupts_its_queue_sample(pg, postgres_url):
    """The master stops and joins the heartbeat before every fork: a queue sample counting
    millions of jobs (here held up by a lock) would hold the fork, and the main loop, for up to
    its bound (12.5 s with the defaults). stop() interrupts it."""
    from supervisor import heartbeat

    beat = heartbeat.Heartbeat(postgres_url, 60.0, 0.05, None, ["default"], on_sample=lambda stats: None)
    with psycopg.connect(postgres_url.split("?")[0]) as locker:
        locker.execute(f"LOCK TABLE {pg._jobs} IN ACCESS EXCLUSIVE MODE")
        beat.start()
        wait_for(lambda: beat.sampling, timeout=30, message="the sample to wait for the lock")
        stopper = threading.Thread(target=beat.stop)
        stopper.start()
        stopper.join(10)  # uninterrupted, the count waits for the lock up to its bound: 29.97 s
        stopped = not stopper.is_alive()
    stopper.join(60)
    assert stopped, "stop() waited for the queue sample"
    # Interrupted is not taken: due again once the heartbeat restarts (frequent forks starved the gauges).
    assert beat.next_sample_at == 0.0
    beat.close()


def test_a_claim_under_type_limits_reads_none_of_the_jobs_scheduled_for_later(pg, postgres_url):
    """The claim under per-type limits runs its statements from Python and read jobs_ready in
    one ordered scan: every job scheduled for later in front of the due ones was read by every
    such claim. Counted in the jobs table's blocks (pg_statio, flushed on demand), not in time."""
    limits = {"t": TypeLimits(max_concurrency=100, exclusive=True)}
    with psycopg.connect(postgres_url.split("?")[0], autocommit=True) as admin:
        def blocks_of_a_claim():
            def blocks():
                pg._conn().execute("SELECT pg_stat_force_next_flush()")
                pg._conn().execute("SELECT 1")  # idle after this: its statistics are flushed
                admin.execute("SELECT pg_stat_clear_snapshot()")
                return admin.execute(
                    "SELECT heap_blks_hit + heap_blks_read + coalesce(idx_blks_hit, 0) + coalesce(idx_blks_read, 0)"
                    " FROM pg_statio_user_tables WHERE schemaname = %s AND relname = 'jobs'",
                    (pg.schema,)).fetchone()[0]
            before = blocks()
            jobs = pg.claim(["default"], 8, 30, "me", limits)
            return blocks() - before, [job.payload["n"] for job in jobs]

        pg.enqueue_many([new({"n": -1}, delay=86400, priority=5) for _ in range(100)])
        few, claimed = blocks_of_a_claim()
        assert claimed == []
        pg.enqueue_many([new({"n": -1}, delay=86400, priority=5) for _ in range(20_000)])
        many, claimed = blocks_of_a_claim()
        assert claimed == [] and many - few <= 40, (few, many)  # walking them: 240 blocks more
        priorities = [0, 1, 0, 1, 3]
        pg.enqueue_many([new({"n": i}, priority=p) for i, p in enumerate(priorities)])
        assert [priorities[n] for n in blocks_of_a_claim()[1]] == [3, 1, 1, 0, 0]
        # Past the probes, more priorities than PRIORITY_PROBES: the rest in one ordered scan, in order.
        pg.enqueue_many([new({"n": i}, priority=-i) for i in range(40)])
        assert [job.payload["n"] for job in pg.claim(["default"], 40, 30, "me", limits)] == list(range(40))


# -- workflows and idempotency keys under concurrency -------------------------------------

@pytest.mark.parametrize("holder", ["chain", "plain"])
def test_a_workflow_racing_another_producer_for_its_key_gets_the_holders_id(pg, other, producer, concurrent,
                                                                             holder):
    """A workflow read the key's holders before another producer's job holding that key
    committed: its insert waited for that commit and then broke the unique index, and the
    caller got "stored concurrently; try again". Now it reads the holders again and gets
    the holder's id, as a plain enqueue does (and SQLite and Redis)."""
    first = new(idempotency_key="order:9").validate()
    theirs = [first, new(depends_on=[first.id])] if holder == "chain" else [first]
    producer.execute("SELECT 1")  # the producer's transaction is open: the workflow's block is a savepoint in it
    held = pg.enqueue_many(theirs, conn=producer)[0]  # not committed yet
    mine = new(idempotency_key="order:9").validate()
    concurrent.start("flow", lambda: other.enqueue_many([mine, new(depends_on=[mine.id])]))
    concurrent.wait_until_waiting(other, "the workflow's insert to wait for the producer's commit")
    producer.commit()
    concurrent.join()
    got = concurrent.results["flow"]
    assert isinstance(got, list) and got[0] == held, got
    assert pg.get(got[1]).state == "waiting" and list(pg.get(got[1]).parents) == [held]
    assert pg.get(mine.id) is None  # the workflow's own first step was never stored
    keyed = pg._execute(f"SELECT count(*) FROM {pg._jobs} WHERE idempotency_key = 'order:9'").fetchone()[0]
    assert keyed == 1
    (job,) = pg.claim(Q, 5, 30, "w")
    assert job.id == held
