"""Batched dispatch: several short jobs in one message to a child, each answered, each accounted for.

The master holds that a child runs the first job of its batch not answered
yet; everything that ends an attempt (a crash, a hard timeout, a stop, a lost
lease) concerns that job only, and the jobs behind it come back untouched.
"""
import signal
import socket
import threading

import pytest

from supervisor import protocol
from supervisor.master import prefetch as PREFETCH
from supervisor.model import NewJob

from .daemon import Daemon, read_lines
from .util import wait_for


def batch_daemon(tmp_path, broker_url, **sections):
    """One child; ``quick`` measured short, so a claim of several is sent as one batch."""
    sections.setdefault("supervisor", {}).update(workers=1)
    d = Daemon(tmp_path, broker_url, **sections)
    d.start()
    wait_measured_short(d)
    return d


def wait_measured_short(d):
    def measured_short():
        # A loaded machine stretches a few runs: more samples bring the moving average down.
        last = [d.wait_job(job_id) for job_id in [d.enqueue("quick") for _ in range(5)]][-1]
        quick = {t["type"]: t for t in d.status()["prefetch"]["types"]}["quick"]
        # And the child's last run short too: after a long one (a hiccup) it gets one job at a time.
        return (quick["prefetch"] >= 3 and quick["average_seconds"] * PREFETCH.BATCH <= PREFETCH.WAIT_BUDGET
                and last.history[-1]["duration"] <= PREFETCH.LONG_RUN)

    wait_for(measured_short, timeout=60, interval=0, message="quick measured short enough to batch")


def enqueue_batch(d, *payloads):
    """Jobs enqueued at once (one transaction): one claim takes them all, one message carries them,
    in the order given (descending priorities: ids made in one millisecond do not sort by time)."""
    return d.broker.enqueue_many([NewJob("quick", p, priority=len(payloads) - i) for i, p in enumerate(payloads)])


def batches_sent(d, size):
    return [r for r in d.records(event="batch") if r["msg"] == f"batch of {size} jobs to worker 0"]


def starts(marker):
    return [line[1] for line in read_lines(marker) if line[0] == "started"]


def held_behind_a_top_up(d, payload, rounds=6):
    """72 jobs in one claim; job 16 holds until ``release`` exists. Returns (ids, marker,
    release) of a round in which a top-up went out before job 16 counted as long.

    The master tops a child up only while its running job is younger than
    ``prefetch.LONG_RUN`` (6 ms). On a loaded machine the loop may first come back
    later than that: then, rightly, nothing is queued behind job 16, ever. Status
    tells the two apart (a job older than the line with 15 or fewer behind it);
    such a round is let run out and another tried.
    """
    for n in range(rounds):
        marker, release = d.marker(f"m{n}"), d.marker(f"release{n}")
        p = dict(payload, marker=marker)
        ids = enqueue_batch(d, *([p] * 16 + [dict(p, release=release)] + [p] * 55))
        wait_for(lambda: ids[16] in starts(marker), message="job 16, which holds, running")

        def settled():
            w = d.status()["workers"][0]
            if w["job_id"] == ids[16] and w["queued"] > 15:
                return "topped up"
            if w["job_id"] == ids[16] and w["elapsed"] is not None and w["elapsed"] > PREFETCH.LONG_RUN:
                return "too late"
            return None

        if wait_for(settled, timeout=30, message="job 16 topped up, or past the line") == "topped up":
            return ids, marker, release
        open(release, "w").close()
        assert [d.wait_job(job_id).state for job_id in ids] == ["done"] * len(ids)
        wait_measured_short(d)
    raise AssertionError(f"no top-up went out in {rounds} rounds: the master's loop never came back within 6 ms")


def release_every_round(d, rounds=6):
    for n in range(rounds):
        open(d.marker(f"release{n}"), "w").close()


def test_only_the_running_job_of_a_batch_is_crashed_the_rest_released_and_run(tmp_path, broker_url):
    d = batch_daemon(tmp_path, broker_url)
    marker = d.marker("m")
    try:
        ids = enqueue_batch(d, {"marker": marker}, {"marker": marker, "die": True}, {"marker": marker},
                            {"marker": marker})
        jobs = [d.wait_job(job_id) for job_id in ids]
        assert batches_sent(d, 4), "the four jobs went to the child as one batch"
        assert [(j.state, j.attempt) for j in jobs] == [("done", 1), ("done", 2), ("done", 1), ("done", 1)]
        assert [h["outcome"] for h in jobs[1].history] == ["retry", "done"]
        assert jobs[1].history[0]["error"]["reason"] == "crashed"
        for j in (jobs[0], jobs[2], jobs[3]):
            assert [h["outcome"] for h in j.history] == ["done"]  # released: no attempt spent, none recorded
        assert starts(marker).count(ids[2]) == starts(marker).count(ids[3]) == 1  # never started in the dead child
        assert d.status()["counters"]["crashed"] == 1
        d.assert_clean()
    finally:
        d.stop()


def test_replies_read_in_one_piece_with_a_bad_frame_end_their_jobs_as_they_say(tmp_path, broker_url):
    """The master reads a child's replies and, in the same read, a bad frame its next job wrote
    into the pipe (a handler gone wrong): the jobs those replies answer are done, and only the job
    that wrote the frame is judged by it. The replies were dropped with the frame, and the first
    finished job was dead-lettered for a frame it never sent (the one behind it in the next batch).
    The master is stopped while the child works, so that everything lies in the pipe at once."""
    d = batch_daemon(tmp_path, broker_url)
    marker, release = d.marker("m"), d.marker("release")
    try:
        ids = enqueue_batch(d, {"marker": marker, "release": release}, {"marker": marker},
                            {"marker": marker, "garbage": True})
        wait_for(lambda: ids[0] in starts(marker), message="the first job, which holds, running")
        wait_for(lambda: d.status()["workers"][0]["queued"] == 2, message="the other two queued in the child")
        d.signal(signal.SIGSTOP)
        try:
            open(release, "w").close()
            wait_for(lambda: any(line[0] == "sending" for line in read_lines(marker)),
                     message="the third job's bad frame written behind the two replies")
        finally:
            d.signal(signal.SIGCONT)
        jobs = [d.wait_job(job_id) for job_id in ids]
        assert [(j.state, j.attempt) for j in jobs[:2]] == [("done", 1), ("done", 1)]
        assert (jobs[2].state, jobs[2].reason, jobs[2].attempt) == ("dead", "result_too_large", 1)
        assert [h["outcome"] for h in jobs[0].history] == [h["outcome"] for h in jobs[1].history] == ["done"]
        d.assert_clean()
    finally:
        d.stop()


def test_a_hard_timeout_second_in_its_batch_kills_for_that_job_only(tmp_path, broker_url):
    d = batch_daemon(tmp_path, broker_url, jobs={"types": {"quick": {"timeout": 1.0}}})
    marker = d.marker("m")
    try:
        ids = enqueue_batch(d, {"marker": marker}, {"marker": marker, "spin": True}, {"marker": marker})
        jobs = [d.wait_job(job_id) for job_id in ids]
        assert batches_sent(d, 3)
        assert [(j.state, j.attempt) for j in jobs] == [("done", 1), ("done", 2), ("done", 1)]
        assert jobs[1].history[0]["error"]["reason"] == "timeout"
        assert [h["outcome"] for h in jobs[2].history] == ["done"]
        counters = d.status()["counters"]
        assert (counters["timeouts"], counters["crashed"]) == (1, 0)
        d.assert_clean()
    finally:
        d.stop()


def test_graceful_stop_finishes_the_running_job_and_releases_the_rest_of_its_batch(tmp_path, broker_url):
    d = batch_daemon(tmp_path, broker_url)
    marker, release = d.marker("m"), d.marker("release")
    try:
        ids = enqueue_batch(d, {"marker": marker, "release": release}, {"marker": marker}, {"marker": marker})
        wait_for(lambda: starts(marker) == [ids[0]], message="the first job of the batch running")
        assert batches_sent(d, 3)
        d.signal(signal.SIGTERM)
        wait_for(lambda: d.status()["stopping"] == "graceful", message="the stop to begin")
        open(release, "w").close()
        assert d.wait_exit() == 0
        first, *rest = [d.job(job_id) for job_id in ids]
        assert (first.state, first.attempt) == ("done", 1)
        assert [(j.state, j.attempt) for j in rest] == [("queued", 0), ("queued", 0)]  # back, untouched
        assert starts(marker) == [ids[0]]  # the rest never started
        d.assert_clean()
    finally:
        d.stop()


def test_every_job_of_a_batch_has_its_lease_renewed(tmp_path, broker_url):
    # A lease a few heartbeats long: renewed in time even on a loaded machine.
    d = batch_daemon(tmp_path, broker_url, broker={"lease_seconds": 2.0, "heartbeat_seconds": 0.2})
    marker, release = d.marker("m"), d.marker("release")
    try:
        ids = enqueue_batch(d, {"marker": marker, "release": release}, {"marker": marker}, {"marker": marker})
        wait_for(lambda: starts(marker) == [ids[0]], message="the first job of the batch running")
        assert batches_sent(d, 3)
        claimed = {job_id: d.job(job_id).lease_until for job_id in ids}
        # Every lease, the queued ones' too, renewed past the expiry it was claimed with.
        wait_for(lambda: all(d.job(job_id).lease_until > claimed[job_id] + 2.0 for job_id in ids), timeout=20,
                 message="every lease of the batch renewed past its first expiry")
        open(release, "w").close()
        jobs = [d.wait_job(job_id) for job_id in ids]
        assert [(j.state, j.attempt) for j in jobs] == [("done", 1)] * 3
        assert d.status()["counters"]["lease_lost"] == 0
        d.assert_clean()
    finally:
        d.stop()


def test_a_cancel_reaches_only_its_job_of_a_batch(tmp_path, broker_url):
    """The running job is interrupted (``Cancelled`` at a safe point); a queued one cancelled
    ends ``cancelled`` without starting; the others of the batch run once, untouched."""
    d = batch_daemon(tmp_path, broker_url, broker={"heartbeat_seconds": 0.2})
    marker, release = d.marker("m"), d.marker("release")
    try:
        ids = enqueue_batch(d, {"marker": marker, "release": release}, {"marker": marker}, {"marker": marker},
                            {"marker": marker})
        wait_for(lambda: starts(marker) == [ids[0]], message="the first job of the batch running")
        assert batches_sent(d, 4)
        assert d.broker.cancel([ids[2]], by="ops", reason="queued") == {ids[2]: "requested"}
        assert d.wait_job(ids[2], states=("cancelled", "done", "dead")).state == "cancelled"
        assert d.broker.cancel([ids[0]], by="ops", reason="running") == {ids[0]: "requested"}
        jobs = [d.wait_job(job_id, states=("cancelled", "done", "dead")) for job_id in ids]
        assert [j.state for j in jobs] == ["cancelled", "done", "cancelled", "done"]
        assert [j.attempt for j in jobs] == [1, 1, 1, 1]
        assert ids[2] not in starts(marker)  # cancelled while queued: never started
        assert sorted(starts(marker)) == sorted([ids[0], ids[1], ids[3]])  # each once
        assert d.status()["counters"]["cancelled"] == 2
        d.assert_clean()
    finally:
        open(release, "w").close()
        d.stop()


def test_a_busy_child_gets_its_next_batch_before_it_runs_out_and_each_job_runs_once(tmp_path, broker_url):
    d = batch_daemon(tmp_path, broker_url)
    marker = d.marker("m")
    try:
        # Half a millisecond each: a batch lasts long enough for the master to see it run low.
        # A saturated machine can stretch the measured runs past the batching line for a while
        # (no batch, rightly, so no top-up): rounds until one is topped up, each checked.
        ids, topped = [], []
        for _ in range(6):
            wait_measured_short(d)
            n = 6 * PREFETCH.BATCH
            batch = d.broker.enqueue_many([NewJob("quick", {"marker": marker, "pause": 0.0005}) for _ in range(n)])
            jobs = [d.wait_job(job_id) for job_id in batch]
            assert [(j.state, j.attempt) for j in jobs] == [("done", 1)] * n
            ids += batch
            topped = [r for r in d.records(event="batch") if r["msg"].endswith(" (busy)")]
            if topped:
                break
        assert sorted(starts(marker)) == sorted(ids)  # each once
        assert topped, "no batch was sent to a child still running the one before"
        d.assert_clean()
    finally:
        d.stop()


def test_nothing_is_queued_behind_a_short_types_job_that_runs_long(tmp_path, broker_url):
    """A job of a type measured short that runs long now is the long-job trap: jobs queued
    behind it in its child would wait while a sibling supervisor may sit idle. Its child
    has answered enough short jobs of its batch to be fed the next one, but not while that
    job runs: the new jobs stay prefetched in the master (free to go to another child)."""
    d = batch_daemon(tmp_path, broker_url)
    marker, release = d.marker("m"), d.marker("release")
    held = PREFETCH.REFILL + 3  # answered before it: past the point where a child is topped up
    try:
        ids = enqueue_batch(d, *([{"marker": marker}] * held + [{"marker": marker, "release": release}]
                                 + [{"marker": marker}] * (PREFETCH.BATCH - held - 1)))
        wait_for(lambda: ids[held] in starts(marker), message="the holding job running")
        assert batches_sent(d, PREFETCH.BATCH), "the jobs went to the child as one batch"
        wait_for(lambda: (d.status()["workers"][0]["elapsed"] or 0) >= 0.05, message="it running long")
        rest = [d.enqueue("quick", {"marker": marker}) for _ in range(3)]
        wait_for(lambda: d.status()["prefetched"] == 3, message="the three new jobs claimed and kept in the master")
        assert d.status()["workers"][0]["queued"] == PREFETCH.BATCH - held - 1  # nothing added behind it
        open(release, "w").close()
        jobs = [d.wait_job(job_id) for job_id in ids + rest]
        assert [(j.state, j.attempt) for j in jobs] == [("done", 1)] * len(jobs)
        assert sorted(starts(marker)) == sorted(ids + rest)  # each once
        d.assert_clean()
    finally:
        open(release, "w").close()
        d.stop()


def test_a_pause_hands_back_its_queues_jobs_queued_in_a_childs_batch(tmp_path, broker_url):
    """Jobs of a queue paused while they wait in a child's batch behind a running job have not
    started: like the prefetched ones, they go back to the broker at once and stay there
    until the queue is resumed (an operator pauses a queue because something is broken)."""
    d = batch_daemon(tmp_path, broker_url)
    marker, release = d.marker("m"), d.marker("release")
    try:
        ids = enqueue_batch(d, {"marker": marker, "release": release}, *([{"marker": marker}] * 3))
        wait_for(lambda: ids[0] in starts(marker), message="the first job of the batch running")
        assert batches_sent(d, 4) and d.status()["workers"][0]["queued"] == 3
        d.broker.pause("default", by="ops")
        wait_for(lambda: d.status()["paused_queues"] == ["default"] and d.status()["workers"][0]["queued"] == 0
                 and [d.job(j).state for j in ids[1:]] == ["queued"] * 3,
                 message="the pause seen and the three queued jobs handed back")
        open(release, "w").close()
        assert d.wait_job(ids[0]).state == "done"
        wait_for(lambda: d.status()["workers"][0]["state"] == "idle", message="the child idle")
        assert [(d.job(j).state, d.job(j).attempt) for j in ids[1:]] == [("queued", 0)] * 3
        assert starts(marker) == [ids[0]]
        d.broker.resume("default")
        jobs = [d.wait_job(job_id) for job_id in ids]
        assert [(j.state, j.attempt) for j in jobs] == [("done", 1)] * 4
        assert sorted(starts(marker)) == sorted(ids)  # each once
        d.assert_clean()
    finally:
        open(release, "w").close()
        d.stop()


@pytest.mark.parametrize("how", ["cancel", "stop"])
def test_a_job_handed_back_behind_a_topped_up_child_never_starts_there(tmp_path, how):
    """A child running job 16 of its batch with a top-up (the next batch) already in its
    pipe: a cancel of a queued job, or a stop, hands the queued jobs back (SKIP). The
    child must read the SKIP behind the top-up before it starts another job: reading
    one frame per job, it started job 17 although the master had handed it back (a
    cancelled job's handler ran; a stop released a job that had run)."""
    d = batch_daemon(tmp_path, None, broker={"heartbeat_seconds": 0.2})
    try:
        # The top-up goes out as job 16 starts: its child then holds more than the 15 behind it.
        ids, marker, release = held_behind_a_top_up(d, {})
        if how == "cancel":
            d.broker.cancel([ids[17]], by="ops", reason="queued")
            assert d.wait_job(ids[17], states=("cancelled", "done", "dead")).state == "cancelled"
        else:
            d.signal(signal.SIGTERM)
            wait_for(lambda: d.status()["stopping"] == "graceful", message="the stop to begin")
        open(release, "w").close()
        if how == "stop":
            assert d.wait_exit() == 0
            job = d.job(ids[17])
            assert (job.state, job.attempt) == ("queued", 0)  # back, untouched
        else:
            jobs = [d.wait_job(job_id, states=("cancelled", "done", "dead")) for job_id in ids]
            assert [j.state for j in jobs].count("cancelled") == 1
            assert sorted(starts(marker)) == sorted(set(ids) - {ids[17]})  # each other job once
            status = d.status()  # the child's count is of jobs run (what max_jobs_per_child counts)
            assert status["workers"][0]["jobs_done"] == status["counters"]["succeeded"]
        assert ids[17] not in starts(marker)
        d.assert_clean()
    finally:
        release_every_round(d)
        d.stop()


def test_a_reload_takes_back_the_batch_queued_behind_an_old_childs_running_job(tmp_path):
    """SIGHUP retires the old generation's children after their current job; the jobs queued
    behind that job are handed back at once and run on the new generation's child, not
    behind a job that may run long, under the old handlers."""
    d = batch_daemon(tmp_path, None)
    marker, release = d.marker("m"), d.marker("release")
    try:
        p = {"marker": marker}
        ids = enqueue_batch(d, dict(p, release=release), p, p)
        wait_for(lambda: ids[0] in starts(marker), message="the first job, which holds, running")
        assert batches_sent(d, 3)
        old = d.status()["workers"][0]["pid"]
        d.signal(signal.SIGHUP)
        later = [d.wait_job(job_id, timeout=20) for job_id in ids[1:]]  # while the first still holds
        assert [(j.state, j.attempt) for j in later] == [("done", 1), ("done", 1)]
        ran_on = {line[1]: int(line[2]) for line in read_lines(marker) if line[0] == "started"}
        assert old not in (ran_on[ids[1]], ran_on[ids[2]])
        open(release, "w").close()
        assert d.wait_job(ids[0]).state == "done"
        d.assert_clean()
    finally:
        open(release, "w").close()
        d.stop()


def test_a_child_terminated_over_a_hard_timeout_starts_no_other_job_of_its_batch(tmp_path):
    """The hard timeout's SIGTERM ends the running job (``JobTimeout``); the master then
    hands back the jobs queued behind it and kills the child after ``kill_grace``. The child
    must leave after its reply, not start the next job of its batch meanwhile: that job
    would run there, cut off by the SIGKILL, and again elsewhere."""
    d = batch_daemon(tmp_path, None, jobs={"types": {"quick": {"timeout": 1.0}}}, supervisor={"kill_grace": 20})
    marker = d.marker("m")
    try:
        ids = enqueue_batch(d, {"marker": marker, "spin": True}, {"marker": marker}, {"marker": marker})
        jobs = [d.wait_job(job_id) for job_id in ids]
        assert batches_sent(d, 3)
        assert [(j.state, j.attempt) for j in jobs] == [("done", 2), ("done", 1), ("done", 1)]
        assert jobs[0].history[0]["error"]["reason"] == "timeout"
        assert [starts(marker).count(job_id) for job_id in ids] == [2, 1, 1]
        d.assert_clean()
    finally:
        d.stop()


def test_a_top_up_larger_than_the_pipe_never_stalls_the_master_nor_splits_a_message(tmp_path):
    """A top-up goes to a child busy with a job, which reads nothing until that job ends.
    A top-up of jobs with large payloads is more than the socket buffer holds: a blocking
    send stalled the whole master until the child read (up to its 5 s socket timeout),
    then left half a message in the pipe. The child then waited for the rest of it while
    the master took its next job for running. The master queues what the pipe cannot take
    and sends it as the child reads, between its other work."""
    d = batch_daemon(tmp_path, None, broker={"heartbeat_seconds": 0.2})
    try:
        ids, marker, release = held_behind_a_top_up(d, {"pad": "x" * 40_000})  # 32 of them: 1.3 MB, far over a socket buffer
        # The master goes on serving while the top-up waits: a job enqueued now is claimed.
        late = d.enqueue("quick", {"marker": marker})
        wait_for(lambda: d.job(late).state == "running" or d.status()["prefetched"] >= 1,
                 message="the master claiming while the top-up waits for the child")
        for _ in range(20):  # each answered within 5 s: the loop never stalls on the child's pipe
            assert d.status()["workers"][0]["job_id"] == ids[16]
        open(release, "w").close()
        jobs = [d.wait_job(job_id) for job_id in ids + [late]]
        assert [(j.state, j.attempt) for j in jobs] == [("done", 1)] * len(jobs)
        assert sorted(starts(marker)) == sorted(ids + [late])  # each once
        d.assert_clean()
    finally:
        release_every_round(d)
        d.stop()


def test_a_frame_larger_than_the_socket_buffer_arrives_whole_and_in_order():
    """``protocol.write_frame``: one write for what the buffer takes, ``sendall`` for the rest,
    from where the write stopped (a master's socket to its child has a timeout, as here)."""
    master_end, child_end = socket.socketpair()
    master_end.settimeout(5.0)
    frame = protocol.encode({"op": protocol.RUN, "blob": "".join(f"{i:07d}" for i in range(200_000))})
    assert len(frame) > master_end.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) * 2  # no single write takes it
    got = []
    reader = threading.Thread(target=lambda: got.append(protocol.recv(child_end)), daemon=True)
    reader.start()
    try:
        protocol.write_frame(master_end, frame)
        reader.join(30)
        small = protocol.encode({"op": protocol.STOP})
        protocol.write_frame(master_end, small)  # taken whole by one write
        assert protocol.recv(child_end) == {"op": protocol.STOP}
    finally:
        child_end.shutdown(socket.SHUT_RDWR)  # wakes a reader still waiting for the rest
        master_end.close()
        child_end.close()
    assert got and got[0]["blob"] == "".join(f"{i:07d}" for i in range(200_000))
