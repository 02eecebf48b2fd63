"""The SQLite broker's tables: created where missing, never written into when foreign.

Every statement is ``IF NOT EXISTS``, so migrating is idempotent and a newer
table or index simply joins an older file. A table of one of Tangguh's names
that lacks Tangguh's columns belongs to someone else and is refused.
"""
import os
import sqlite3
import urllib.parse

from ...errors import ConfigError

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    queue TEXT NOT NULL,
    type TEXT NOT NULL,
    payload TEXT NOT NULL,
    state TEXT NOT NULL,
    resource_id TEXT,
    idempotency_key TEXT,
    attempt INTEGER NOT NULL DEFAULT 0,
    max_attempts INTEGER NOT NULL,
    timeout REAL,
    priority INTEGER NOT NULL DEFAULT 0,
    run_at REAL NOT NULL,
    queued_at REAL NOT NULL,
    trace_id TEXT,
    token INTEGER NOT NULL DEFAULT 0,
    lease_until REAL,
    owner TEXT,
    result TEXT,
    error TEXT,
    reason TEXT,
    first_failure_at REAL,
    last_failure_at REAL,
    finished_at REAL,
    history TEXT NOT NULL DEFAULT '[]'
);
CREATE INDEX IF NOT EXISTS jobs_ready ON jobs (queue, priority DESC, run_at, id)
    WHERE state IN ('queued', 'retrying');
CREATE INDEX IF NOT EXISTS jobs_leased ON jobs (lease_until) WHERE state = 'running';
CREATE INDEX IF NOT EXISTS jobs_finished ON jobs (state, finished_at) WHERE state IN ('done', 'dead');
CREATE UNIQUE INDEX IF NOT EXISTS jobs_idempotency ON jobs (idempotency_key)
    WHERE idempotency_key IS NOT NULL AND state IN ('queued', 'running', 'retrying');
CREATE TABLE IF NOT EXISTS rate_buckets (type TEXT PRIMARY KEY, tokens REAL NOT NULL, updated_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS once_keys (key TEXT PRIMARY KEY, created_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS schedule_ticks (name TEXT PRIMARY KEY, key TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS paused_queues (queue TEXT PRIMARY KEY, paused_by TEXT, paused_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS supervisors (
    id TEXT PRIMARY KEY, record TEXT NOT NULL, last_heartbeat REAL NOT NULL, ttl REAL NOT NULL);
"""

# Job control (issue 15): columns an older file gets with ALTER TABLE, then their index.
ADDED_COLUMNS = {"expires_at": "REAL", "progress": "REAL", "progress_note": "TEXT", "cancel_request": "TEXT"}
AFTER_COLUMNS = """
CREATE INDEX IF NOT EXISTS jobs_expiring ON jobs (queue, expires_at)
    WHERE expires_at IS NOT NULL AND state IN ('queued', 'retrying');
CREATE INDEX IF NOT EXISTS jobs_ended ON jobs (finished_at) WHERE state IN ('cancelled', 'expired');
"""

# Job control's search (backends/sqlite/search.py): each filter's index, keyed by the
# page's order (queued_at, id). Payload fields have none: see that module.
SEARCH_INDEXES = """
CREATE INDEX IF NOT EXISTS jobs_search_queued ON jobs (queued_at, id);
CREATE INDEX IF NOT EXISTS jobs_search_state ON jobs (state, queued_at, id);
CREATE INDEX IF NOT EXISTS jobs_search_queue ON jobs (queue, queued_at, id);
CREATE INDEX IF NOT EXISTS jobs_search_type ON jobs (type, queued_at, id);
CREATE INDEX IF NOT EXISTS jobs_search_resource ON jobs (resource_id, queued_at, id) WHERE resource_id IS NOT NULL;
CREATE INDEX IF NOT EXISTS jobs_search_idempotency ON jobs (idempotency_key) WHERE idempotency_key IS NOT NULL;
CREATE INDEX IF NOT EXISTS jobs_search_finished ON jobs (finished_at) WHERE finished_at IS NOT NULL;
"""

# stats() (issue 16): every count it takes is a range of this index, read without the
# table (a covering index), so a queue of a million ready jobs costs a walk over small
# index entries, not a million row lookups. Not partial: every state is counted.
STATS_INDEX = """
CREATE INDEX IF NOT EXISTS jobs_stats ON jobs (queue, state, run_at);
"""

# The columns that make a jobs table Tangguh's.
JOB_COLUMNS = {"id", "queue", "type", "payload", "state", "attempt", "token", "lease_until", "history"}
# Every table of Tangguh's, with the columns it has had since it was first made (job_edges'
# parent_gone came later: workflows.migrate adds it). An application's own "supervisors" or
# "paused_queues" table was kept by CREATE TABLE IF NOT EXISTS: the daemon started, and every
# heartbeat, or every claim, then failed on a missing column, an outage that never ended.
TABLE_COLUMNS = {
    "jobs": JOB_COLUMNS,
    "rate_buckets": {"type", "tokens", "updated_at"},
    "once_keys": {"key", "created_at"},
    "schedule_ticks": {"name", "key"},
    "paused_queues": {"queue", "paused_by", "paused_at"},
    "supervisors": {"id", "record", "last_heartbeat", "ttl"},
    "job_edges": {"parent", "child", "on_", "state", "result"},
}


def check(db, path):
    """ConfigError if a table of one of Tangguh's names is someone else's; reads only."""
    for table, ours in TABLE_COLUMNS.items():
        columns = {row[1] for row in db.execute(f"PRAGMA table_info({table})")}  # row[1]: the name
        if columns and not ours <= columns:
            # CREATE TABLE IF NOT EXISTS would keep it and write our rows into it.
            raise ConfigError(f"sqlite database {path} has a {table} table that is not Tangguh's:"
                              " give the broker a database file of its own")


def check_file(path):
    """``check`` on the file at ``path`` if there is one, opened read-only: ``config check``
    said ok to a file whose foreign table then made ``run`` exit 2; it must not create the file.
    A file it cannot read (not a database, locked) is left to ``run``, which names it."""
    if not os.path.isfile(path):
        return
    try:
        db = sqlite3.connect(f"file:{urllib.parse.quote(os.path.abspath(path))}?mode=ro", uri=True)
    except sqlite3.Error:
        return
    try:
        check(db, path)
    except sqlite3.Error:
        pass
    finally:
        db.close()


def migrate(db, path):
    """Create what is missing; run inside the caller's write transaction."""
    check(db, path)
    for statement in (SCHEMA + SEARCH_INDEXES + STATS_INDEX).split(";"):
        if statement.strip():
            db.execute(statement)
    columns = {row["name"] for row in db.execute("PRAGMA table_info(jobs)")}
    for name, kind in ADDED_COLUMNS.items():
        if name not in columns:
            db.execute(f"ALTER TABLE jobs ADD COLUMN {name} {kind}")
    for statement in AFTER_COLUMNS.split(";"):
        if statement.strip():
            db.execute(statement)
