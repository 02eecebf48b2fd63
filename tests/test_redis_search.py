"""The Redis broker's search index: kept in step with the jobs, built for old jobs, and its state-set path."""
import pytest

from supervisor.backends import open_broker
from supervisor.backends.redis import search as redis_search
from supervisor.jobfilter import JobFilter
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
