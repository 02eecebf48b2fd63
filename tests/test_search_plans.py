"""Every search filter is served by an index: the plans SQLite and PostgreSQL choose, by index name.

The statement explained is the one the broker runs (``_page_sql``), on a few
thousand jobs where each filtered value is rare, as on a large broker. On
PostgreSQL the table is analyzed and sequential scans are priced out
(``enable_seqscan = off``): the planner's statistics on a small table are not
those of a large one; what the test proves is that an index can serve the
filter, and which.
"""
import pytest

from supervisor.backends import open_broker
from supervisor.jobfilter import JobFilter
from supervisor.model import NewJob

N = 4000

# filter -> the index that must serve it (SQLite, PostgreSQL)
CASES = [
    ({}, "jobs_search_queued", "jobs_search_queued"),
    ({"state": ["dead"]}, "jobs_search_state", "jobs_search_state"),
    # PostgreSQL: a rare queue's ten jobs read through jobs_stats (queue, state, run_at) and sorted
    # cost the same as jobs_search_queue; a large queue's page walks jobs_search_queue (issue 16).
    ({"queue": "q7"}, "jobs_search_queue", ("jobs_search_queue", "jobs_stats")),
    ({"type": "t7"}, "jobs_search_type", "jobs_search_type"),
    ({"resource_id": "r7"}, "jobs_search_resource", "jobs_search_resource"),
    ({"idempotency_key": "k7"}, "jobs_search_idempotency", "jobs_search_idempotency"),
    ({"queued_after": 1.0, "queued_before": 4e9}, "jobs_search_queued", "jobs_search_queued"),
    ({"finished_after": 1.0}, "jobs_search_finished", "jobs_search_finished"),
    ({"finished_before": 4e9}, "jobs_search_finished", "jobs_search_finished"),
    ({"error": "declined"}, "jobs_search_state", "jobs_search_state"),
    # SQLite checks payload fields row by row (see backends/sqlite/search.py), in an index's order
    ({"payload": {"customer.id": 7}}, "jobs_search_queued", "jobs_search_payload"),
    ({"type": "t7", "payload": {"customer.id": 7}}, "jobs_search_type", None),
]


@pytest.fixture(params=["sqlite", "postgres"])
def filled(request):
    url = request.getfixturevalue(f"{request.param}_url")
    broker = open_broker(url)
    broker.migrate()
    broker.enqueue_many([NewJob(f"t{i % 400}", {"customer": {"id": i}, "n": i}, queue=f"q{i % 400}",
                                resource_id=f"r{i % 400}", idempotency_key=f"k{i}") for i in range(N)])
    if request.param == "postgres":
        broker._execute(f"ANALYZE {broker._jobs}")
    yield request.param, broker
    broker.close()


def plan(kind, broker, f):
    sql, params = broker._page_sql(f, None, "newest", "id, queued_at", 51)
    if kind == "sqlite":
        return "\n".join(row[3] for row in broker.db.execute("EXPLAIN QUERY PLAN " + sql, params))
    db = broker._conn()
    with db.transaction():
        db.execute("SET LOCAL enable_seqscan = off")
        return "\n".join(row[0] for row in db.execute("EXPLAIN " + sql, params))


@pytest.mark.parametrize("spec,sqlite_index,postgres_index", CASES, ids=[str(c[0]) for c in CASES])
def test_each_filter_is_served_by_its_index(filled, spec, sqlite_index, postgres_index):
    kind, broker = filled
    want = sqlite_index if kind == "sqlite" else postgres_index
    if want is None:
        pytest.skip("either index serves it")
    got = plan(kind, broker, JobFilter.from_dict(spec))
    assert any(name in got for name in ((want,) if isinstance(want, str) else want)), got
    assert "SCAN jobs\n" not in got + "\n" and "Seq Scan" not in got, got


def test_the_next_page_is_a_range_of_the_same_index(filled):
    kind, broker = filled
    sql, params = broker._page_sql(JobFilter(type="t7"), (2e9, "job_z"), "newest", "id, queued_at", 51)
    if kind == "sqlite":
        got = "\n".join(r[3] for r in broker.db.execute("EXPLAIN QUERY PLAN " + sql, params))
        assert "jobs_search_type (type=? AND (queued_at,id)<(?,?))" in got, got
    else:
        got = "\n".join(r[0] for r in broker._execute("EXPLAIN " + sql, params))
        assert "jobs_search_type" in got and "ROW(queued_at, id) <" in got, got
