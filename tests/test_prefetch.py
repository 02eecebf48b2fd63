"""``broker.prefetch = "auto"``: short job types are prefetched, long ones never wait in a busy supervisor."""
import os
import time

from supervisor import config
from supervisor.master.dispatch import Dispatcher
from supervisor.master.prefetch import BYTES, PER_CHILD, WAIT_BUDGET, Prefetch
from supervisor.model import Job, NewJob

from .daemon import Daemon, read_lines, tangguh
from .test_batches import wait_measured_short
from .util import wait_for


def measured(d, job_type, payload, done, message):
    """Runs ``job_type`` jobs one at a time until ``done(its prefetch row)``: waiting alone moves no
    average, and on a loaded machine a few runs may not yet have brought a short type's down."""
    def row():
        d.wait_job(d.enqueue(job_type, payload))
        found = {t["type"]: t for t in d.status()["prefetch"]["types"]}.get(job_type)
        return found if found is not None and done(found) else None
    return wait_for(row, timeout=60, interval=0, message=message)


def test_auto_prefetch_follows_each_types_run_time():
    p = Prefetch("auto", 2)
    assert (p.room(), p.for_type("quick")) == (0, 0)  # nothing measured: nothing prefetched
    for _ in range(3):
        p.ran("quick", 0.001)
        p.ran("slow", 2.0)
    assert (p.for_type("quick"), p.for_type("slow"), p.room()) == (PER_CHILD * 2, 0, PER_CHILD * 2)
    for _ in range(30):
        p.ran("quick", 1.0)  # the type turned long: its prefetch follows the average down
    assert p.for_type("quick") == 0
    p.configure("auto", 2, served={"slow"})
    assert [t["type"] for t in p.view()["types"]] == ["slow"]  # a type no longer served is forgotten
    for i in range(1000):  # a producer's unknown type names are not measured: the table stays bounded
        p.ran(f"unknown-{i}", 0.001)
    assert [t["type"] for t in p.view()["types"]] == ["slow"]
    pinned = Prefetch(3, 2)
    pinned.ran("slow", 5.0)
    assert (pinned.for_type("slow"), pinned.room(), pinned.view()["mode"]) == (3, 3, 3)
    # Batches: only types a whole batch of which runs within the wait budget (pinned or not).
    pinned.ran("quick", 0.001)
    assert (pinned.batchable("quick"), pinned.batchable("slow"), pinned.batchable("unmeasured")) == (
        True, False, False)


def dispatcher(types, give_back, pool=None):
    """A dispatcher of 2 children over ``pool`` (none: ``surplus`` alone needs none)."""
    cfg = config.from_dict({"supervisor": {"workers": 2}, "broker": {"prefetch": "auto"}})
    return Dispatcher(cfg, dict.fromkeys(types), "host:1:ab", link=None, pool=pool, prefetch=Prefetch("auto", 2),
                      hold=None, settings_for=None, on_claimed=None, on_unknown=None, on_expired=None,
                      give_back=give_back, on_started=lambda job: None)


def job_of(job_type, n):
    return Job(id=f"{job_type}-{n}", type=job_type, queue="default", payload={})


def test_a_short_types_hiccup_hands_no_prefetched_job_back():
    """A short type's average moves with every run: one run of 20 ms (a scheduler's hiccup on a
    busy machine) took a 1 ms type's prefetch from 64 to 20, and the dispatcher handed 44
    claimed jobs back, a release round trip each, to claim them again a moment later (4 % of
    the bench's no-ops). A short type's jobs are handed back only beyond a band above its
    prefetch now; a slower type keeps its prefetch and a long one none, and large jobs no more
    than their bytes allow."""
    given_back = []
    d = dispatcher(["quick", "middling", "slow", "large"], given_back.append)

    def claimed(job_type, n):
        d.prefetched.extend((job_of(job_type, i), None) for i in range(n))

    def surplus():
        given_back.clear()
        d.surplus()
        return [job.type for job in given_back]

    for _ in range(5):
        d.ran("quick", 0.001)
    claimed("quick", PER_CHILD * 2)
    assert surplus() == []
    d.ran("quick", 0.020)
    assert d.prefetch.for_type("quick") < PER_CHILD  # the claims shrink with the average
    assert surplus() == []  # and what is here stays
    assert d.prefetch.view()["types"][0]["keep"] == PER_CHILD * 2  # status shows both
    d.ran("quick", 0.040)  # on average 12 ms, under the band's edge: 8 may be claimed, 4 times that stay
    count, kept = d.prefetch.for_type("quick"), d.prefetch.keep("quick")
    assert 0 < count < PER_CHILD // 2 and kept == 4 * count, (count, kept)
    assert surplus() == ["quick"] * (PER_CHILD * 2 - kept) and len(d.prefetched) == kept
    for _ in range(30):
        d.ran("quick", 1.0)  # the type turned long: everything waiting goes back
    assert surplus() == ["quick"] * kept and not d.prefetched
    d.ran("middling", 0.030)  # 3 run within the wait budget: no band, they would wait 4 times as long
    claimed("middling", 6)
    assert surplus() == ["middling"] * 3
    d.ran("slow", 2.0)
    claimed("slow", 1)
    assert surplus() == ["slow"]  # a long type keeps none, band or not
    d.ran("large", 0.001)
    d.prefetch.weigh(["large"], BYTES // 4)
    claimed("large", 6)
    assert surplus() == ["large"] * 2  # four fit in BYTES: the bytes bound has no band
    # Several types waiting: each is held to what it may keep, whatever room another type has.
    d.prefetched.clear()
    claimed("middling", 2)
    claimed("slow", 1)
    assert surplus() == ["slow"] and [job.type for job, _ in d.prefetched] == ["middling"] * 2


def test_a_run_that_lowers_what_a_type_may_keep_looks_again_at_its_waiting_jobs():
    """A child's run can make its type long: the jobs of that type waiting here go back at the next
    dispatch (``recheck``), not after the next claim. A run that changes nothing asks for no look."""
    d = dispatcher(["quick"], lambda job: None)
    for _ in range(5):
        d.ran("quick", 0.001)
    d.prefetched.extend((job_of("quick", i), None) for i in range(8))
    d.recheck = False  # looked at since the claim
    d.ran("quick", 0.001)
    assert not d.recheck  # the same keep: nothing to look at
    d.ran("quick", 2.0)
    assert d.recheck and d.prefetch.keep("quick") == 0


def test_larger_jobs_sent_look_again_at_what_waits_even_when_the_claims_stay_the_same():
    """What a type may keep can fall while its prefetch does not: a 10 ms type of jobs of
    ``BYTES`` / 40 may be claimed 10 at a time (its run time) and keep 40 (its bytes). Larger
    jobs sent to a child bring its bytes bound to 24: the jobs beyond it go back at the next
    dispatch, not only after a claim (a type in the band held 13 MB so)."""
    given_back = []

    class Pool:  # the dispatcher's one call here: a message of ``nbytes`` sent
        nbytes = 0

        def run(self, c, batch, start_by=None):
            c.sent_bytes = self.nbytes
            return []

    class Child:
        sent_bytes = 0

    pool = Pool()
    d = dispatcher(["middling"], given_back.append, pool)
    d.ran("middling", 0.010)
    pool.nbytes = BYTES // 40
    d.send(Child(), [(job_of("middling", 0), None)])
    assert (d.prefetch.for_type("middling"), d.prefetch.keep("middling")) == (10, 40)
    d.prefetched.extend((job_of("middling", i), None) for i in range(1, 41))
    d.recheck = False  # looked at since: all 40 may stay
    pool.nbytes = BYTES // 10
    d.send(Child(), [(job_of("middling", 41), None)])
    kept = d.prefetch.keep("middling")
    assert d.prefetch.for_type("middling") == 10 and kept < 40, kept
    assert d.recheck  # the next dispatch hands back what no longer fits
    d.surplus()
    assert (len(given_back), len(d.prefetched)) == (40 - kept, kept)


def test_a_prefetched_jobs_start_by_time_leaves_with_the_job():
    """Each claimed job with an expiry left its start-by time behind when it was sent to a
    child or handed back: with expiries of hours, the table grew with every such job (8.6 M
    entries a day at 100 jobs/s), and every dispatch walked it."""
    given_back = []

    class Link:
        def call(self, sent, what):
            return claimed, []

    class Pool:
        target, children, generation = 2, {}, 1

        def free(self):
            return [Child()]

        def live(self):
            return []

        def run(self, c, batch, start_by=None):
            c.sent_bytes = 100
            return []

    class Child:
        ran_long, jobs_done, sent_bytes = False, 0, 0

    d = dispatcher(["quick", "slow"], given_back.append, Pool())
    d.link, d.hold, d.on_claimed, d.settings_for = Link(), lambda lease: None, lambda job: None, lambda job: None
    for _ in range(3):
        d.ran("quick", 0.001)
        d.ran("slow", 2.0)  # keeps none: its jobs beyond a free child go back
    for round_ in range(50):
        claimed = [Job(id=f"{t}-{round_}-{i}", type=t, queue="default", payload={}, token=1,
                       expires_at=time.time() + 86400, lease_until=time.time() + 5)
                   for t, i in [("quick", 0), ("quick", 1), ("slow", 0), ("slow", 1)]]
        d.next_claim_at = 0.0
        d.claim()
        d.dispatch()
    assert d.prefetched or given_back  # some went to children, some back
    assert set(d.start_by) == {job.id for job, _ in d.prefetched}
    d.take_all()
    assert d.start_by == {}


def test_a_long_job_never_waits_behind_another_while_a_sibling_supervisor_is_idle(tmp_path, broker_url):
    a = Daemon(tmp_path / "a", broker_url, supervisor={"workers": 1})
    b = Daemon(tmp_path / "b", broker_url, supervisor={"workers": 1})
    release = str(tmp_path / "release")
    marker = str(tmp_path / "naps")
    try:
        a.start()
        # a learns: noop is short (its claims now take jobs beyond its idle child), nap is long.
        for job_id in [a.enqueue("noop") for _ in range(3)] + [a.enqueue("nap", {"seconds": 0.3})]:
            a.wait_job(job_id)
        measured(a, "noop", {}, lambda t: t["prefetch"] > 0, "noop measured short enough to prefetch")
        chosen = {t["type"]: t["prefetch"] for t in a.status()["prefetch"]["types"]}
        assert a.status()["prefetch"]["mode"] == "auto"
        assert chosen["noop"] > 0 and chosen["nap"] == 0, chosen
        # Two long jobs while a is the only supervisor: it claims both, runs one, and must
        # not keep the other waiting behind it.
        first, second = a.broker.enqueue_many([NewJob("nap", {"release": release, "marker": marker})
                                               for _ in range(2)])
        b.start(wait=False)  # it takes the job handed back at once: its child is never idle to wait for
        # Both run at once, on the two supervisors: the first holds a's only child until released.
        started = wait_for(lambda: (lines := [ln for ln in read_lines(marker) if ln[0] == "started"])
                           and len(lines) == 2 and lines, timeout=20, message="both long jobs running")
        assert {line[1] for line in started} == {first, second}
        assert len({line[2] for line in started}) == 2  # two children: one of a, one of b
        open(release, "w").close()
        for job_id in (first, second):
            job = a.wait_job(job_id)
            assert (job.state, job.attempt) == ("done", 1)  # the handing back cost no attempt
        pids = {a.job(job_id).history[-1]["pid"] for job_id in (first, second)}
        assert pids == {int(line[2]) for line in started}
        a.assert_clean()
    finally:
        if not os.path.exists(release):
            open(release, "w").close()
        a.stop()
        b.stop()


def test_a_prefetched_job_whose_expiry_passes_while_it_waits_ends_expired_never_run(tmp_path, broker_url):
    """A short job claimed while the only child was busy waited in the master past its expiry,
    then ran and ended done: "a job not started by then ends expired" held only in the broker.
    Handed back untouched now, it is ended expired by the next claim, no attempt spent."""
    d = Daemon(tmp_path, broker_url, supervisor={"workers": 1})
    release = d.marker("release")
    try:
        d.start()
        for job_id in [d.enqueue("noop") for _ in range(3)]:
            d.wait_job(job_id)  # noop is short: claims take it beyond the idle child
        measured(d, "noop", {}, lambda t: t["prefetch"] > 0, "noop measured short enough to prefetch")
        held = d.enqueue("hold", {"release": release})
        wait_for(lambda: d.job(held).state == "running", message="the child busy")
        late = d.enqueue("noop", expires_in=0.5)
        wait_for(lambda: d.status()["prefetched"] == 1, message="the expiring job prefetched")
        wait_for(lambda: d.broker.now() > d.job(late).expires_at + 0.1, message="its expiry passed")
        # Handed back by the master itself, while its child is still busy (the child would skip it
        # too, but only once free): ended by the next claim.
        wait_for(lambda: d.job(late).state == "expired", timeout=15, message="the late job ended while the child is busy")
        assert d.job(held).state == "running"
        open(release, "w").close()
        job = d.wait_job(late, states=("done", "expired"))
        assert (job.state, job.attempt) == ("expired", 0), job.history
        assert d.wait_job(held).state == "done"
        d.assert_clean()
    finally:
        open(release, "w").close()
        d.stop()


def test_a_batched_job_whose_expiry_passes_behind_a_long_job_of_its_batch_ends_expired_never_run(tmp_path, broker_url):
    """Jobs of a short type go to a child in batches; one queued there behind a job of its batch
    that turned out long started once that one ended, past its expiry, and ended done: only the
    jobs waiting in the master were handed back. The child now skips a job whose start-by
    instant passed, and the next claim ends it expired, no attempt spent."""
    d = Daemon(tmp_path, broker_url, supervisor={"workers": 1})
    release = d.marker("release")
    try:
        d.start()
        # Runs quick jobs until its average is short enough to batch and the child's last run short:
        # waiting alone changes no average, and a loaded machine may need more samples than a few.
        wait_measured_short(d)
        # One claim, one batch: the long one first (its priority), the expiring ones behind it.
        ids = d.broker.enqueue_many([NewJob("quick", {"release": release}, priority=10)]
                                    + [NewJob("quick", {}, expires_in=1.0) for _ in range(5)])
        held, late = ids[0], ids[1:]
        wait_for(lambda: d.job(held).state == "running" and d.status()["prefetched"] == 0,
                 message="the long job running, the others queued in its child")
        wait_for(lambda: d.broker.now() > max(d.job(j).expires_at for j in late) + 0.1, message="their expiry passed")
        open(release, "w").close()
        jobs = [d.wait_job(j, states=("done", "expired")) for j in late]
        assert [(job.state, job.attempt) for job in jobs] == [("expired", 0)] * 5, [job.history for job in jobs]
        assert d.wait_job(held).state == "done"
        d.assert_clean()
    finally:
        open(release, "w").close()
        d.stop()


def test_a_backlog_of_long_jobs_is_claimed_a_child_at_a_time_once_handed_back(tmp_path):
    """Once any short type had run, each claim asked for the free child plus a short type's
    room, and each child's end reopened that room: a backlog of long jobs was claimed whole
    and handed back at every completion (40 jobs of 0.5 s: 781 claims, each job's fencing
    token up by 18), and ``tangguh_jobs_claimed_total`` counted every claim as an attempt."""
    from .test_metrics import samples, value

    d = Daemon(tmp_path, supervisor={"workers": 1})
    try:
        d.start()
        for job_id in [d.enqueue("noop") for _ in range(3)] + [d.enqueue("nap", {"seconds": 0.1})]:
            d.wait_job(job_id)  # noop is short (a claim's room is 32), nap long (it keeps none)
        ids = d.broker.enqueue_many([NewJob("nap", {"seconds": 0.05}) for _ in range(8)])
        assert [d.wait_job(job_id).state for job_id in ids] == ["done"] * 8
        claims = [len(d.records(job_id=job_id, event="claim")) for job_id in ids]
        # The first claim takes all eight and hands seven back; then one claim a child's end.
        assert sum(claims) <= 2 * len(ids), claims
        scrape = samples(tangguh("metrics", "-c", d.config_path).stdout)
        assert value(scrape, "tangguh_jobs_claimed_total", queue="default", type="nap") == 1 + len(ids)
        d.assert_clean()
    finally:
        d.stop()


def test_large_jobs_are_prefetched_a_few_at_a_time(tmp_path):
    """A quick type with large payloads counted as short: 32 jobs per child waited in the
    master, each decoded, several times its size (ten 7 MB payloads: a 0.9 GB peak). At most
    ``BYTES`` of one type's jobs wait now, as measured in the messages to the children."""
    d = Daemon(tmp_path, supervisor={"workers": 1})
    release = d.marker("release")
    big = {"pad": "x" * (BYTES // 4)}  # a quarter of the budget: four may wait
    try:
        d.start()
        for job_id in [d.enqueue("noop", big) for _ in range(5)]:
            assert d.wait_job(job_id).state == "done"
        # Its run time alone would let more than three wait: the bytes are what holds it to three.
        noop = measured(d, "noop", big, lambda t: t["average_seconds"] * 3 <= WAIT_BUDGET,
                        "noop measured short enough that its run time allows three")
        assert noop["average_bytes"] > BYTES // 4 and noop["prefetch"] == 3, noop  # 4 jobs' messages overshoot 8 MiB
        held = d.enqueue("hold", {"release": release})
        wait_for(lambda: d.job(held).state == "running", message="the child busy")
        ids = d.broker.enqueue_many([NewJob("noop", big) for _ in range(12)])  # one claim could take them all
        wait_for(lambda: d.status()["prefetched"] == 3, message="large jobs prefetched")
        for _ in range(20):  # the claims go on while the child is busy: never more than the three
            assert d.status()["prefetched"] <= 3
        open(release, "w").close()
        assert [d.wait_job(job_id).state for job_id in ids + [held]] == ["done"] * 13
        d.assert_clean()
    finally:
        open(release, "w").close()
        d.stop()
