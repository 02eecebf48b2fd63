"""Fixtures for the toolkit tests: the handlers' PostgreSQL schema and a Redis key prefix.

Import the fixtures by name into a test module. ``handlers_db`` is a fresh
PostgreSQL schema (dropped after the test) with ``idempotency_records`` and the
invoice example's tables; ``toolkit_redis`` is a Redis URL with its own key
prefix (keys deleted after the test).
"""
import importlib.util
import os

import pytest

from supervisor import toolkit
from supervisor.toolkit.transaction import transaction

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INVOICES = os.path.join(ROOT, "supervisor", "data", "handlers", "invoices.py")


def load_invoices():
    spec = importlib.util.spec_from_file_location("tangguh_test_invoices_direct", INVOICES)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


invoices = load_invoices()


@pytest.fixture
def handlers_db(postgres_url):
    toolkit.migrate(postgres_url)
    db = toolkit.Database(postgres_url)
    with transaction(db) as tx:
        invoices.create_schema(tx)
    db.close()
    return postgres_url


@pytest.fixture
def toolkit_redis(redis_url):
    return redis_url


def new_invoice(db_url, invoice_id, amounts):
    """Insert an invoice with its items (its total is not computed: that is the job's work)."""
    db = toolkit.Database(db_url)
    with transaction(db) as tx:
        tx.execute("INSERT INTO invoices (id) VALUES (%s)", (invoice_id,))
        for amount in amounts:
            tx.execute("INSERT INTO invoice_items (invoice_id, amount) VALUES (%s, %s)", (invoice_id, amount))
    db.close()


def query(db_url, sql, params=()):
    """One row of a query, as a dict, on a fresh connection."""
    db = toolkit.Database(db_url)
    try:
        with transaction(db) as tx:
            return tx.fetchone(sql, params)
    finally:
        db.close()
