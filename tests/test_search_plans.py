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
from supervisor.jobfilter import Count, JobFilter
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


# A payload value most jobs carried long ago and none lately ("a customer who left"): the
# statistics say one job in ten matches, so the planner, asked for the newest matches, walks
# jobs_search_queued from the newest job expecting a match every ten rows, and reads the
# 18,000 newer jobs first. Nothing here is priced out: this is the plan the broker gets.
OLD_SHARE, MANY = 2000, 20000


@pytest.fixture
def gone_customer(postgres_url):
    broker = open_broker(postgres_url)
    broker.migrate()
    for start in range(0, MANY, 2000):
        broker.enqueue_many([NewJob("t", {"customer": {"id": 7 if i < OLD_SHARE else i}, "n": i, "plan": "basic"})
                             for i in range(start, start + 2000)])
    broker._execute(f"ANALYZE {broker._jobs}")
    yield broker
    broker.close()


def test_a_payload_search_reads_the_gin_index_even_when_the_planner_expects_many_matches(gone_customer):
    broker = gone_customer
    f = JobFilter.from_dict({"payload": {"customer.id": 7}})
    got = broker._explain_page(f, None, "newest", "id, queued_at", 51)
    assert "jobs_search_payload" in got, got
    assert "jobs_search_queued" not in got and "Seq Scan" not in got, got
    # and the next page's statement too (the cursor is a filter on what the index selects)
    page = broker.search(f, None, 50)
    key = (page.jobs[-1].queued_at, page.jobs[-1].id)
    got = broker._explain_page(f, key, "newest", "id, queued_at", 51)
    assert "jobs_search_payload" in got and "jobs_search_queued" not in got, got


def every_page(broker, f, limit):
    """(the matches' keys in page order, the pages' sizes)."""
    seen, sizes, cursor = [], [], None
    while True:
        page = broker.search(f, cursor, limit)
        seen += [(j.queued_at, j.id) for j in page.jobs]
        sizes.append(len(page.jobs))
        cursor = page.next_cursor
        if cursor is None:
            return seen, sizes


def test_a_payload_search_pages_through_every_match_newest_first(gone_customer):
    broker = gone_customer
    seen, sizes = every_page(broker, JobFilter.from_dict({"payload": {"customer.id": 7}}), 200)
    assert sizes == [200] * 10  # each page full: the index gave every match past the cursor
    assert len(seen) == OLD_SHARE == len(set(seen))
    assert seen == sorted(seen, reverse=True)
    assert {broker.get(i).payload["n"] for _, i in seen} == set(range(OLD_SHARE))


def test_a_value_most_jobs_have_is_walked_in_order_within_the_scan_bound(gone_customer):
    # 20,000 matches: past GIN_BOUND, so the pages walk jobs_search_queued, full at once (every row
    # matches), until fewer than GIN_BOUND are left past the cursor and the index serves the rest.
    broker = gone_customer
    seen, sizes = every_page(broker, JobFilter.from_dict({"payload": {"plan": "basic"}}), 500)
    assert len(seen) == MANY == len(set(seen)) and seen == sorted(seen, reverse=True)
    assert sizes == [500] * (MANY // 500)


def test_a_walk_past_rare_matches_stops_at_the_scan_bound_with_a_cursor(gone_customer, monkeypatch):
    # With the probe's bound below the 2,000 old matches, the walk from the newest job reads
    # SCAN_BOUND rows per call and finds none in the first three calls: short pages with a cursor.
    from supervisor.backends import scan
    from supervisor.backends.postgres import search

    monkeypatch.setattr(search, "GIN_BOUND", 500)
    broker = gone_customer
    seen, sizes = every_page(broker, JobFilter.from_dict({"payload": {"customer.id": 7}}), 50)
    newer = MANY - OLD_SHARE
    assert sizes[:newer // scan.SCAN_BOUND] == [0] * (newer // scan.SCAN_BOUND)
    assert len(seen) == OLD_SHARE == len(set(seen)) and seen == sorted(seen, reverse=True)


def test_a_payload_count_counts_every_match_in_the_index(gone_customer):
    # No walk and no scan bound: 20,000 matches counted exactly when asked to
    broker = gone_customer
    assert broker.count(JobFilter.from_dict({"payload": {"plan": "basic"}}), exact_up_to=MANY) == Count(MANY, True)
    assert broker.count(JobFilter.from_dict({"payload": {"customer.id": 7}})) == Count(OLD_SHARE, True)


@pytest.fixture
def unanalyzed(postgres_url):
    """200,000 jobs, one with an idempotency key, and no statistics yet (a broker just after a bulk
    load, before autovacuum analyzed it: off here), so the planner guesses hundreds of rows for
    an equality. Below ~150,000 rows it sorts the guess instead; enqueue_many would take 20 s for
    them, so the rows are written as enqueue writes them, in one statement."""
    broker = open_broker(postgres_url)
    broker.migrate()
    broker._execute(f"ALTER TABLE {broker._jobs} SET (autovacuum_enabled = false)")
    broker._execute(
        f"INSERT INTO {broker._jobs} (id, queue, type, payload, state, idempotency_key, max_attempts, run_at,"
        " queued_at) SELECT 'job_' || i, 'default', 't', json_build_object('n', i), 'queued',"
        " CASE WHEN i = 10 THEN 'cron:nightly:1' END, 3, 1.7e9 + i / 1000.0, 1.7e9 + i / 1000.0"
        " FROM generate_series(0, 199999) i")
    yield broker
    broker.close()


def test_an_idempotency_key_is_looked_up_in_its_index_without_statistics(unanalyzed):
    # The schedules page: each schedule's last run, bounded to the jobs since its tick. Guessing hundreds
    # of matches, the planner would walk jobs_search_queued from the newest job for the first one.
    broker = unanalyzed
    for f in (JobFilter(idempotency_key="cron:nightly:1"), JobFilter(idempotency_key="cron:nightly:1", queued_after=1.0)):
        got = broker._explain_page(f, None, "newest", "id, queued_at", 2)
        assert "jobs_search_idempotency" in got and "jobs_search_queued" not in got, got
        assert [j.payload["n"] for j in broker.search(f, None, 1).jobs] == [10]
