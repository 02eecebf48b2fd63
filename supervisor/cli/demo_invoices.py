"""``tangguh demo invoices``: the invoice example end to end, on a real supervisor.

    tangguh demo invoices [--database-url URL] [--redis-url URL]

The handlers' database defaults to a throwaway SQLite file (a PostgreSQL URL
without ``?schema=`` gets a throwaway schema, dropped at the end); Redis
defaults to ``redis://127.0.0.1:6379/0`` under a throwaway key prefix. The
broker is a throwaway SQLite file. The tour: create the schema, cache the
invoice's summary, run ``recalculate_invoice`` (twice for one version: the
second run is suppressed by the idempotency key), show the summary again (the
cache tag was invalidated after the commit), then add an item and
recalculate a new version.
"""
import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid

import tomli_w

from .. import toolkit
from ..health import NoSupervisor, request
from ..model import NewJob
from ..toolkit.cache import Cache
from ..toolkit.transaction import transaction
from .common import DATA, UsageError
from .demo import wait_until

HANDLERS = os.path.join(DATA, "handlers")
INVOICE_ID = 1001


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, as every other command's (not the usage above it)
        raise UsageError(f"demo invoices: {message}")


def main(argv=()):
    parser = _Parser(prog="tangguh demo invoices", description=__doc__.split("\n\n")[0])
    parser.add_argument("--database-url", default="", help="handlers' database (default: a temporary SQLite file)")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0", help="Redis for the cache and locks")
    args = parser.parse_args(list(argv))
    folder = tempfile.mkdtemp(prefix="tangguh-demo-invoices-")
    tag = uuid.uuid4().hex[:8]
    db_url, dropped_schema = args.database_url or f"sqlite:///{folder}/invoices.db", None
    if toolkit.database_kind(db_url) == "postgres" and "schema=" not in db_url:
        dropped_schema = f"tangguh_demo_{tag}"
        db_url += ("&" if "?" in db_url else "?") + f"schema={dropped_schema}"
    redis_url = args.redis_url + ("&" if "?" in args.redis_url else "?") + f"prefix=tangguh-demo-{tag}:"
    tour = Tour(folder, db_url, redis_url)
    try:
        return tour.run()
    except Exception as exc:  # noqa: BLE001 - a demo says what went wrong in one line
        print(f"tangguh: error: demo invoices: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        tour.cleanup(dropped_schema)
        shutil.rmtree(folder, ignore_errors=True)


class Tour:
    def __init__(self, folder, db_url, redis_url):
        self.folder, self.db_url, self.redis_url = folder, db_url, redis_url
        self.socket = os.path.join(folder, "tangguh.sock")
        self.config = os.path.join(folder, "tangguh.toml")
        self.broker_url = f"sqlite:///{folder}/broker.db"
        self.proc = None
        self.redis = None
        with open(self.config, "wb") as f:
            tomli_w.dump({
                "supervisor": {"workers": 2, "handlers": HANDLERS, "socket": self.socket},
                "broker": {"url": self.broker_url, "lease_seconds": 10.0, "heartbeat_seconds": 1.0},
                "jobs": {"backoff_base": 0.3, "backoff_cap": 2.0},
                "log": {"format": "text", "level": "warning"},
                "toolkit": {"database_url": db_url, "redis_url": redis_url},
            }, f)

    def say(self, text):
        print(text, flush=True)

    def run(self):
        from ..backends import open_broker

        invoices = load_invoices()
        toolkit.migrate(self.db_url)
        self.db = toolkit.Database(self.db_url)
        with transaction(self.db) as tx:
            invoices.create_schema(tx)
            tx.execute("INSERT INTO invoices (id) VALUES (%s)", (INVOICE_ID,))
            for amount in (1250, 4999, 300):
                tx.execute("INSERT INTO invoice_items (invoice_id, amount) VALUES (%s, %s)", (INVOICE_ID, amount))
        self.redis, prefix = toolkit.open_redis(self.redis_url)
        self.redis.ping()
        cache = Cache(self.redis, prefix)
        summary = lambda: invoices.invoice_summary(cache, lambda: transaction(self.db), INVOICE_ID)  # noqa: E731
        self.say(f"Invoice {INVOICE_ID} has 3 items; its stored total is not computed yet.")
        self.say(f"  summary (now cached under tag invoice:{INVOICE_ID}): {summary()}")

        self.say("Starting a supervisor with 2 children (handlers/invoices.py)...")
        self.proc = subprocess.Popen([sys.executable, "-m", "supervisor.cli", "run", "-c", self.config],
                                     stdout=open(os.path.join(self.folder, "daemon.log"), "wb"),
                                     stderr=subprocess.STDOUT)
        wait_until(self.ping, "the supervisor to start")
        broker = open_broker(self.broker_url)
        try:
            payload = {"invoice_id": INVOICE_ID, "version": 1}
            first = broker.enqueue(NewJob("recalculate_invoice", payload))
            self.say(f"recalculate_invoice {payload}: {self.done(broker, first).result}")
            again = broker.enqueue(NewJob("recalculate_invoice", payload))
            self.say(f"the same version again (a duplicate delivery): {self.done(broker, again).result}"
                     " - the effect was skipped, the stored result returned")
            self.say(f"  summary (cache invalidated after the commit, rebuilt): {summary()}")
            with transaction(self.db) as tx:
                tx.execute("INSERT INTO invoice_items (invoice_id, amount) VALUES (%s, %s)", (INVOICE_ID, 700))
            self.say("An item of 700 is added; recalculate_invoice version 2...")
            self.done(broker, broker.enqueue(NewJob("recalculate_invoice", {"invoice_id": INVOICE_ID, "version": 2})))
            self.say(f"  summary: {summary()}")
            with transaction(self.db) as tx:
                row = tx.fetchone("SELECT total, version, recalculations FROM invoices WHERE id = %s", (INVOICE_ID,))
            counters = request(self.socket, {"cmd": "status"})["counters"]
            self.say(f"Stored: {row}; duplicates suppressed: {counters['duplicates_suppressed']}")
        finally:
            broker.close()
        self.say("See docs/safe-handlers.md for how the handler is written.")
        return 0

    def done(self, broker, job_id):
        job = wait_until(lambda: (j := broker.get(job_id)) is not None and j.state in ("done", "dead") and j,
                        f"job {job_id}")
        if job.state != "done":
            raise RuntimeError(f"job {job_id} was dead-lettered: {job.error}")
        return job

    def ping(self):
        if self.proc.poll() is not None:
            raise RuntimeError(f"the supervisor exited with {self.proc.returncode} (see its log above)")
        try:
            status = request(self.socket, {"cmd": "status"})
        except (NoSupervisor, OSError, ValueError):
            return False
        return any(w["state"] == "idle" for w in status["workers"])


    def cleanup(self, dropped_schema):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.redis is not None:
            _, prefix = toolkit.open_redis(self.redis_url)
            for key in self.redis.scan_iter(match=f"{prefix}*", count=1000):
                self.redis.delete(key)
            self.redis.close()
        if getattr(self, "db", None) is not None:
            self.db.close()
        if dropped_schema:
            import psycopg

            from ..backends.postgres import libpq_conninfo

            with psycopg.connect(libpq_conninfo(self.db_url, ("schema",))[0], autocommit=True) as conn:
                conn.execute(f'DROP SCHEMA IF EXISTS "{dropped_schema}" CASCADE')


def load_invoices():
    import importlib.util

    spec = importlib.util.spec_from_file_location("tangguh_demo_invoices", os.path.join(HANDLERS, "invoices.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
