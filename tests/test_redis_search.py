"""The Redis broker's search indexes (the queue's and each type's): kept in step with the jobs, built for old
jobs, and the paths a search takes (the state sets, a type's index)."""
import pytest

from supervisor.backends import open_broker, scan
from supervisor.backends.redis import search as redis_search
from supervisor.backends.redis.keys import SCRIPT_KEYS
from supervisor.jobfilter import Count, JobFilter
from supervisor.model import NewJob, error_info

from .util import wait_for

pytestmark = pytest.mark.services


@pytest.fixture
def rb(redis_url):
    b = open_broker(redis_url + "&done_ttl=1")
    b.migrate()
    yield b
    b.close()


def index_size(b, queue="default"):
    return b.r.zcard(b._search_key(queue))


def type_size(b, job_type, queue="default"):
    return b.r.zcard(b._type_key(queue, job_type))


def done_set(b, queue="default"):
    return b.keys.for_scripts(queue)[0][SCRIPT_KEYS.index("done")]


def types_named(b, queue="default"):
    return b.r.smembers(b._search_key(queue) + ":types")


def test_a_done_job_whose_hash_expired_leaves_the_index_at_prune(rb):
    job_id = rb.enqueue(NewJob("t", {}))
    rb.ack(rb.claim(["default"], 1, 30, "w")[0].lease)
    wait_for(lambda: not rb.r.exists(rb.keys.job("default", job_id)), message="the done job's hash to expire")
    assert index_size(rb) == 1
    rb.prune(3600)  # nothing old enough to delete: the sweep alone
    assert index_size(rb) == 0 and rb.count(JobFilter()).n == 0


def test_migrate_indexes_jobs_stored_before_the_index(rb):
    ids = rb.enqueue_many([NewJob("t", {"i": i}) for i in range(5)])
    rb.r.delete(rb._search_key("default"), f"{rb.prefix}:{redis_search._BACKFILLED}")
    assert rb.search(JobFilter()).jobs == []
    rb.migrate()
    assert [j.id for j in rb.search(JobFilter(), order="oldest").jobs] == sorted(ids)  # one queued_at: by id
    rb.migrate()  # once: a second migrate changes nothing
    assert index_size(rb) == 5


@pytest.mark.parametrize("drive_max", [2, 20_000])
def test_a_state_search_gives_the_same_pages_from_the_state_sets_or_the_index(rb, monkeypatch, drive_max):
    monkeypatch.setattr(redis_search, "STATE_DRIVE_MAX", drive_max)
    rb.enqueue_many([NewJob("t", {"i": i}) for i in range(8)])
    dead = []
    for job in rb.claim(["default"], 5, 30, "w"):
        rb.dead(job.lease, "exception", error_info("exception", "E", "boom"))
        dead.append(job.id)
    seen, cursor = [], None
    while True:
        page = rb.search(JobFilter(state=["dead"]), cursor=cursor, limit=2)
        seen += [j.id for j in page.jobs]
        cursor = page.next_cursor
        if cursor is None:
            break
    assert sorted(seen) == sorted(dead) and len(seen) == len(set(seen))
    assert rb.count(JobFilter(state=["dead"])).n == 5


def test_a_search_by_type_reads_its_index_where_the_bounded_scan_would_come_back_short(rb):
    rare = rb.enqueue_many([NewJob("rare", {"i": i}, resource_id=f"r{i % 2}") for i in range(12)])
    # Newer jobs of another type, more than the scan checks in one call, stand between a
    # newest-first walk of the queue's index and the rare ones.
    rb.enqueue_many([NewJob("common", {"i": i}) for i in range(scan.SCAN_BOUND + 100)])
    page = rb.search(JobFilter(type="rare"), limit=10)
    assert len(page.jobs) == 10 and page.next_cursor is not None
    rest = rb.search(JobFilter(type="rare"), cursor=page.next_cursor, limit=10)
    assert len(rest.jobs) == 2 and rest.next_cursor is None
    assert sorted(j.id for j in page.jobs + rest.jobs) == sorted(rare)
    # The other filters are still checked, row by row, on what the type's index yields.
    by_resource = rb.search(JobFilter(type="rare", resource_id="r1"), limit=50)
    assert sorted(j.id for j in by_resource.jobs) == sorted(rare[1::2]) and by_resource.next_cursor is None
    assert rb.search(JobFilter(type="rare", queue="other")).jobs == []
    # A count by type alone is the index's size: exact past the bound.
    assert rb.count(JobFilter(type="common"), exact_up_to=10**6) == Count(scan.SCAN_BOUND + 100, True)
    assert rb.count(JobFilter(type="rare", resource_id="r0")) == Count(6, True)
    assert rb.count(JobFilter(type="nothing")) == Count(0, True)


def test_every_enqueue_path_fills_the_type_index(rb):
    a = rb.enqueue(NewJob("a", {}))
    b = rb.enqueue_once(NewJob("b", {}, idempotency_key="once"))
    parent, child = rb.enqueue_many([NewJob("a", {}, id="job_parent"),
                                     NewJob("c", {}, id="job_child", depends_on=["job_parent"])])
    assert (type_size(rb, "a"), type_size(rb, "b"), type_size(rb, "c")) == (2, 1, 1)
    assert types_named(rb) == {"a", "b", "c"} and index_size(rb) == 4
    assert sorted(j.id for j in rb.search(JobFilter(type="a")).jobs) == sorted([a, parent])
    assert [j.id for j in rb.search(JobFilter(type="c")).jobs] == [child]
    assert [j.id for j in rb.search(JobFilter(type="b")).jobs] == [b]


def test_discard_purge_and_prune_take_jobs_out_of_the_type_index(rb):
    ids = rb.enqueue_many([NewJob("a", {"i": i}) for i in range(3)] + [NewJob("b", {"i": i}) for i in range(4)])
    assert (type_size(rb, "a"), type_size(rb, "b"), index_size(rb)) == (3, 4, 7)
    assert rb.discard([ids[0], ids[3]]) == {ids[0]: "discarded", ids[3]: "discarded"}
    assert (type_size(rb, "a"), type_size(rb, "b"), index_size(rb)) == (2, 3, 5)
    claimed = {j.id: j for j in rb.claim(["default"], 10, 30, "w")}
    rb.dead(claimed[ids[1]].lease, "exception", error_info("exception", "E", "boom"))
    rb.dlq_purge([ids[1]])
    assert (type_size(rb, "a"), type_size(rb, "b"), index_size(rb)) == (1, 3, 4)
    for job_id in ids[4:6]:
        rb.ack(claimed[job_id].lease)
    rb.prune(0)  # done jobs finished before now: deleted with their entries
    assert (type_size(rb, "a"), type_size(rb, "b"), index_size(rb)) == (1, 1, 2)
    assert rb.count(JobFilter(type="b")) == Count(1, True)


def test_a_done_job_whose_hash_expired_leaves_its_type_index_at_prune(rb):
    gone = rb.enqueue_many([NewJob("gone", {"i": i}) for i in range(3)])
    kept = rb.enqueue(NewJob("kept", {}))
    for job in rb.claim(["default"], 3, 30, "w"):
        rb.ack(job.lease)
    wait_for(lambda: not any(rb.r.exists(rb.keys.job("default", i)) for i in gone),
             message="the done jobs' hashes to expire")
    assert type_size(rb, "gone") == 3 and rb.count(JobFilter(type="gone")).n == 3
    rb.prune(3600)  # nothing old enough to delete: the sweeps alone
    assert (type_size(rb, "gone"), type_size(rb, "kept"), index_size(rb)) == (0, 1, 1)
    assert types_named(rb) == {"kept"}  # an emptied type leaves the types the sweep walks
    assert rb.count(JobFilter(type="gone")) == Count(0, True)
    assert [j.id for j in rb.search(JobFilter(type="kept")).jobs] == [kept]


def test_the_type_sweep_goes_on_where_it_stopped(rb, monkeypatch):
    from supervisor.backends.redis import prune

    monkeypatch.setattr(prune, "BATCH", 2)
    gone = rb.enqueue_many([NewJob(t, {"i": i}) for t in ("x", "y") for i in range(3)])
    for job in rb.claim(["default"], 6, 30, "w"):
        rb.ack(job.lease)
    wait_for(lambda: not any(rb.r.exists(rb.keys.job("default", i)) for i in gone),
             message="the done jobs' hashes to expire")
    rb.r.delete(done_set(rb))  # as a later ack trims it: prune finds none of them there, the sweeps alone do
    sizes = []
    for _ in range(3):  # two entries per call, across the types in name order
        rb.prune(3600)
        sizes.append((type_size(rb, "x"), type_size(rb, "y")))
    assert sizes == [(1, 3), (0, 2), (0, 0)]
    assert types_named(rb) == set()


def test_a_search_by_type_drops_an_expired_job_from_both_indexes(rb):
    done = rb.enqueue(NewJob("t", {}, resource_id="r"))
    rb.ack(rb.claim(["default"], 1, 30, "w")[0].lease)
    wait_for(lambda: not rb.r.exists(rb.keys.job("default", done)), message="the done job's hash to expire")
    assert rb.search(JobFilter(type="t", resource_id="r")).jobs == []  # reads the fields: meets the gone hash
    assert (type_size(rb, "t"), index_size(rb)) == (0, 0)


def test_migrate_builds_the_type_indexes_for_jobs_stored_before_them(rb):
    ids = rb.enqueue_many([NewJob("a" if i % 2 else "b", {"i": i}) for i in range(6)])
    flow = rb.enqueue_many([NewJob("p", {}, id="job_p"), NewJob("c", {}, id="job_c", depends_on=["job_p"])])
    # As a broker of the previous version left them: the queue's index alone, marked complete.
    rb.r.delete(*(rb._type_key("default", t) for t in "abpc"), rb._search_key("default") + ":types",
                f"{rb.prefix}:{redis_search._BACKFILLED}")
    rb.r.zrem(rb._search_key("default"), *[m for m in rb.r.zrange(rb._search_key("default"), 0, -1)
                                            if m[16:] in flow])  # workflows' jobs were not indexed
    rb.r.set(f"{rb.prefix}:search:ready", "true")
    assert rb.search(JobFilter(type="a")).jobs == []
    rb.migrate()
    assert sorted(j.id for j in rb.search(JobFilter(type="a")).jobs) == sorted(ids[1::2])
    assert sorted(j.id for j in rb.search(JobFilter(type="b")).jobs) == sorted(ids[::2])
    assert (type_size(rb, "p"), type_size(rb, "c"), index_size(rb)) == (1, 1, 8)
    assert types_named(rb) == {"a", "b", "p", "c"}
    rb.migrate()  # once: a second migrate changes nothing
    assert (type_size(rb, "a"), type_size(rb, "b")) == (3, 3)


def test_prune_keeps_the_search_index_bounded_under_a_flow_of_done_jobs(redis_url):
    """Done jobs past done_ttl leave both indexes at prune, however many: their hashes outlive
    done_ttl (DONE_GRACE) so prune still reads where their entries are. When the hashes expired
    at done_ttl, prune (with the default retention, as long as done_ttl) found none of them and
    only the sweep took entries out, 1,000 a call once per prune: past about 3 jobs a second
    and queue the indexes grew without end (a week after start, at the flow rate)."""
    from supervisor.backends.redis import prune

    b = open_broker(redis_url + "&done_ttl=5")
    try:
        b.migrate()
        n = prune.BATCH * 2 + 500
        b.enqueue_many([NewJob("t", {"i": i}) for i in range(n)])
        kept = b.enqueue(NewJob("t", {"kept": True}))
        acked = 0
        while acked < n:
            got = b.claim(["default"], 500, 30, "w")
            assert b.ack_many([(j.lease, None, None) for j in got if j.id != kept]) == []
            acked += len([j for j in got if j.id != kept])
        last_ack = b.now()
        wait_for(lambda: b.now() > last_ack + 5.05, message="done_ttl to pass")
        assert b.prune(7 * 86400) == n  # the default retention, past done_ttl
        assert (index_size(b), type_size(b, "t")) == (1, 1)  # the one job not done
        assert [j.id for j in b.search(JobFilter()).jobs] == [kept]
    finally:
        b.close()
