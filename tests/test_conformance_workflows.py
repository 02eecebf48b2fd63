"""Workflows, checked on every broker unchanged: dependencies, release exactly once, cascades.

A job with ``depends_on`` waits until its parents have finished and becomes
``queued`` in the same atomic write as the last parent's end; a parent that
fails cancels its ``on="success"`` children down the tree.
"""
import multiprocessing

import pytest

from supervisor.backends import open_broker
from supervisor.errors import BadInput
from supervisor.model import NewJob, error_info

from .util import wait_for

Q = ["default"]


def new(type_="t", payload=None, **kw):
    return NewJob(type_, {"n": 1} if payload is None else payload, **kw)


def claim_all(broker, n=1000):
    return broker.claim(Q, n, 30, "w")


def claim_ids(broker):
    return {job.id: job for job in claim_all(broker)}


def die(broker, job):
    broker.dead(job.lease, "permanent", error_info("permanent", "Permanent", "no"))


# -- dependencies ----------------------------------------------------------------

def test_a_workflow_resent_with_the_ids_it_chose_is_stored_once_and_another_queue_refused(broker):
    """A producer resending a workflow whose reply it lost gets the same ids back: no second
    job, no second edge, no error (both SQL brokers once failed it for ever, "try again")."""
    flow = lambda: [new("parent", id="job_flow_p"), new("child", id="job_flow_c", depends_on=["job_flow_p"])]  # noqa: E731
    assert broker.enqueue_many(flow()) == ["job_flow_p", "job_flow_c"]
    assert broker.enqueue_many(flow()) == ["job_flow_p", "job_flow_c"]
    with pytest.raises(BadInput, match="job_flow_c.*queue 'default'"):
        broker.enqueue_many([new("parent", id="job_flow_p"),
                             new("child", id="job_flow_c", queue="other", depends_on=["job_flow_p"])])
    assert broker.stats(Q)["default"].ready == 1  # the parent; the child waits for it
    (parent,) = claim_all(broker)
    broker.ack(parent.lease)
    (child,) = claim_all(broker)
    assert child.id == "job_flow_c" and list(child.parents) == ["job_flow_p"]
    assert claim_all(broker) == []


def test_a_child_waits_until_its_parent_is_done_and_then_reads_its_result(broker):
    parent = broker.enqueue(new("fetch"))
    child = broker.enqueue(new("load", depends_on=[parent]))
    assert broker.get(child).state == "waiting"
    assert list(claim_ids(broker)) == [parent]  # the waiting child is not claimable
    broker.ack(broker.get(parent).lease, {"rows": 3})
    assert broker.get(child).state == "queued"
    (got,) = claim_all(broker)
    assert got.id == child
    assert got.parents == {parent: ("done", {"rows": 3})}


def test_a_child_of_finished_parents_is_queued_at_once_and_of_a_failed_one_cancelled(broker):
    ok, bad = broker.enqueue_many([new(), new()])
    jobs = claim_ids(broker)
    broker.ack(jobs[ok].lease, 7)
    die(broker, jobs[bad])
    runs = broker.enqueue(new(depends_on=[ok, (bad, "complete")]))
    skipped = broker.enqueue(new(depends_on=[ok, bad]))
    assert broker.get(runs).state == "queued"
    assert broker.get(runs).parents == {ok: ("done", 7), bad: ("dead", None)}
    assert (broker.get(skipped).state, broker.get(skipped).reason) == ("cancelled", "parent_failed")


def test_fan_in_waits_for_every_parent(broker):
    members = broker.enqueue_many([new(payload={"i": i}) for i in range(5)])
    callback = broker.enqueue(new("summary", depends_on=members))
    jobs = claim_ids(broker)
    for i, member in enumerate(members):
        assert broker.get(callback).state == "waiting"
        broker.ack_many([(jobs[member].lease, i, None)])
    (got,) = claim_all(broker)
    assert got.id == callback
    assert got.parents == {m: ("done", i) for i, m in enumerate(members)}


def test_a_failed_parent_cancels_success_children_down_the_tree_and_releases_complete_ones(broker):
    root = broker.enqueue(new("root"))
    child, always = broker.enqueue_many([new("child", depends_on=[root]), new("always", depends_on=[(root, "complete")])])
    grandchild = broker.enqueue(new("grandchild", depends_on=[(child, "complete")]))
    die(broker, claim_ids(broker)[root])
    assert (broker.get(child).state, broker.get(child).reason) == ("cancelled", "parent_failed")
    # on="complete" runs whatever the outcome, also below a cancelled job.
    assert broker.get(always).state == "queued"
    assert broker.get(grandchild).state == "queued"
    got = claim_ids(broker)
    assert set(got) == {always, grandchild}
    assert got[grandchild].parents == {child: ("cancelled", None)}


def test_a_cascade_runs_down_a_long_chain(broker):
    ids = [broker.enqueue(new("step0"))]
    chain = []
    for i in range(1, 60):
        chain.append(new(f"step{i}", depends_on=[ids[-1] if i == 1 else chain[-1].id]).validate())
    ids += broker.enqueue_many(chain)
    die(broker, claim_ids(broker)[ids[0]])
    assert {broker.get(i).state for i in ids[1:]} == {"cancelled"}
    assert claim_all(broker) == []


def test_a_lease_expiring_into_dead_cascades(broker):
    parent = broker.enqueue(new(max_attempts=1))
    child = broker.enqueue(new(depends_on=[parent]))
    broker.claim(Q, 1, 0.05, "gone")
    wait_for(lambda: broker.claim(Q, 1, 30, "w") == [] and broker.get(parent).state == "dead",
             message="the expired lease to be reclaimed as dead")
    assert (broker.get(child).state, broker.get(child).reason) == ("cancelled", "parent_failed")


def test_replaying_a_dead_parent_reopens_its_cancelled_children(broker):
    parent = broker.enqueue(new())
    child = broker.enqueue(new(depends_on=[parent]))
    grandchild = broker.enqueue(new(depends_on=[child]))
    die(broker, claim_ids(broker)[parent])
    assert broker.get(grandchild).state == "cancelled"
    broker.dlq_replay([parent])
    assert (broker.get(child).state, broker.get(child).reason) == ("waiting", None)
    assert broker.get(grandchild).state == "waiting"
    broker.ack(claim_ids(broker)[parent].lease, "second time")
    got = claim_ids(broker)
    assert list(got) == [child]
    assert got[child].parents == {parent: ("done", "second time")}
    broker.ack(got[child].lease)
    assert list(claim_ids(broker)) == [grandchild]


def test_replay_keeps_a_child_cancelled_while_another_parent_still_failed(broker):
    a, b = broker.enqueue_many([new(), new()])
    child = broker.enqueue(new(depends_on=[a, b]))
    jobs = claim_ids(broker)
    die(broker, jobs[a])
    die(broker, jobs[b])
    broker.dlq_replay([a])
    assert broker.get(child).state == "cancelled"


def test_replay_leaves_cancelled_a_child_whose_idempotency_key_another_job_took(broker):
    """A child cancelled by its failed parent gave up its key; a job that took the key since will
    carry that effect. Replaying (or requeueing) the parent succeeds and leaves the child
    cancelled, naming the holder, so no key ever has two unfinished holders."""
    parent = broker.enqueue(new("parent"))
    child = broker.enqueue(new("child", idempotency_key="invoice-7", depends_on=[parent]))
    grandchild = broker.enqueue(new("grandchild", depends_on=[child]))
    die(broker, claim_ids(broker)[parent])
    # Stored cancelled at once (its parent is dead): it took no key either. Its id sorts after the
    # first child's (siblings reopen in id order), which two ids made in one millisecond may not.
    late = broker.enqueue(new("child", idempotency_key="invoice-7", depends_on=[parent], id=child + "-late"))
    holder = broker.enqueue(new("other", idempotency_key="invoice-7"))
    assert holder not in (child, late)
    assert broker.dlq_replay([parent]) == [parent]
    for kid in (child, late):
        got = broker.get(kid)
        assert (got.state, got.reason, got.cancel_request["key_held_by"]) == ("cancelled", "parent_failed", holder)
    assert broker.get(grandchild).state == "cancelled"
    assert broker.enqueue(new("third", idempotency_key="invoice-7")) == holder
    jobs = claim_ids(broker)
    assert set(jobs) == {parent, holder}
    die(broker, jobs[parent])
    broker.ack(jobs[holder].lease)
    # The key is free again: a requeue reopens the first child, which then holds it alone.
    assert broker.requeue([parent]) == {parent: "queued"}
    got = broker.get(child)
    assert (got.state, got.cancel_request) == ("waiting", None)
    assert (broker.get(late).state, broker.get(late).cancel_request["key_held_by"]) == ("cancelled", child)
    assert broker.get(grandchild).state == "waiting"
    assert broker.enqueue(new("fourth", idempotency_key="invoice-7")) == child


def _dead(broker, type_, **kw):
    job = broker.enqueue(new(type_, max_attempts=1, **kw))
    die(broker, claim_ids(broker)[job])
    return job


@pytest.mark.parametrize("order", ["parent first", "holder first"])
@pytest.mark.parametrize("holder_is", ["a plain job", "a workflow child", "a workflow parent"])
def test_one_replay_of_a_parent_and_a_dead_job_with_its_childs_key_makes_one_holder(broker, order, holder_is):
    """A "mixed" replay: a parent and, in the same call, the dead holder of its cancelled child's
    key (a plain job, a member of another workflow, another workflow's parent). Every broker
    replays both and leaves the child cancelled naming the holder, whatever the order of the
    ids: Redis once reopened the child and put the holder back too (two unfinished holders of
    one key), SQLite refused the call when the parent came first, PostgreSQL when the holder was
    a workflow child (BadInput, nothing replayed). The child is never reopened: its own children
    stay as they were."""
    parent = _dead(broker, "parent")
    child = broker.enqueue(new("child", idempotency_key="invoice-8", depends_on=[parent]))
    grandchild = broker.enqueue(new("grandchild", depends_on=[child]))
    assert broker.get(child).state == broker.get(grandchild).state == "cancelled"
    ended = broker.get(grandchild).finished_at
    kids = []
    if holder_is == "a workflow child":
        first = broker.enqueue(new("first"))
        broker.ack(claim_ids(broker)[first].lease)
        other = broker.enqueue(new("other", max_attempts=1, idempotency_key="invoice-8", depends_on=[first]))
        die(broker, claim_ids(broker)[other])
    else:
        other = _dead(broker, "other", idempotency_key="invoice-8")
        if holder_is == "a workflow parent":
            kids = [broker.enqueue(new("kid", depends_on=[other]))]
    ids = [parent, other] if order == "parent first" else [other, parent]
    assert broker.dlq_replay(ids) == ids
    assert {i: broker.get(i).state for i in (parent, child, other)} == {
        parent: "queued", child: "cancelled", other: "queued"}
    got = broker.get(child)
    assert (got.reason, got.cancel_request["key_held_by"]) == ("parent_failed", other)
    assert [broker.get(kid).state for kid in kids] == ["waiting"] * len(kids)
    # Never reopened, the child's own children are as they were (not cancelled a second time).
    assert (broker.get(grandchild).state, broker.get(grandchild).finished_at) == ("cancelled", ended)
    assert broker.enqueue(new("third", idempotency_key="invoice-8")) == other
    jobs = claim_ids(broker)
    assert set(jobs) == {parent, other}
    broker.ack(jobs[parent].lease)
    assert broker.get(child).state == "cancelled"  # its key is still held: it never runs
    broker.ack(jobs[other].lease)
    assert set(claim_ids(broker)) == set(kids)


def _two_replayable_parents(broker, shape):
    """Two dead jobs and, for each, the cancelled job a replay of it would reopen that has the
    key "invoice-9" (its child, or its grandchild under a child without a key)."""
    if shape == "workflow children":  # themselves children of done parents
        roots = [broker.enqueue(new("root", id=f"job_root_{i}")) for i in range(2)]
        parents = [broker.enqueue(new("parent", max_attempts=1, id=f"job_parent_{i}", depends_on=[r]))
                   for i, r in enumerate(roots)]
        jobs = claim_ids(broker)
        for root in roots:
            broker.ack(jobs[root].lease)
        jobs = claim_ids(broker)
        for parent in parents:
            die(broker, jobs[parent])
    else:
        parents = [_dead(broker, "parent", id=f"job_parent_{i}") for i in range(2)]
    if shape == "grandchildren":
        middles = [broker.enqueue(new("middle", depends_on=[p])) for p in parents]
        return parents, [broker.enqueue(new("child", idempotency_key="invoice-9", depends_on=[m])) for m in middles]
    return parents, [broker.enqueue(new("child", idempotency_key="invoice-9", depends_on=[p])) for p in parents]


@pytest.mark.parametrize("shape", ["plain parents", "workflow children", "grandchildren"])
@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_of_two_cancelled_children_with_one_key_the_first_named_parents_reopens(broker, order, shape):
    """Two dead parents, each with a cancelled child (or grandchild), the children sharing an
    idempotency key, replayed in one call: the child of the parent named first reopens and
    holds the key, the other stays cancelled naming it, on every broker. PostgreSQL reopened
    whichever its statement met first (the table's order), Redis and SQLite the call's."""
    parents, children = _two_replayable_parents(broker, shape)
    first, second = order
    assert broker.dlq_replay([parents[first], parents[second]]) == [parents[first], parents[second]]
    assert broker.get(children[first]).state == "waiting"
    got = broker.get(children[second])
    assert (got.state, got.cancel_request["key_held_by"]) == ("cancelled", children[first])
    assert broker.enqueue(new("third", idempotency_key="invoice-9")) == children[first]


@pytest.mark.parametrize("order", ["parent first", "holder first"])
@pytest.mark.parametrize("holder_is", ["dead", "cancelled", "a dead grandchild's key holder"])
def test_one_requeue_of_a_parent_and_the_holder_of_its_cancelled_childs_key_makes_one_holder(
        broker, order, holder_is):
    """A requeue of a parent and, in the same call, the finished holder of its cancelled child's
    (or grandchild's) idempotency key: every broker answered ``conflict`` for the holder when the
    parent came first (the child reopened and took the key, the holder still finished then) and
    requeued both the other way round. Every job a requeue puts back now holds its key before
    any child reopens, as in a dlq replay: both go back, the child stays cancelled naming it."""
    parent = _dead(broker, "parent")
    if holder_is == "a dead grandchild's key holder":
        middle = broker.enqueue(new("middle", depends_on=[parent]))
        child = broker.enqueue(new("child", idempotency_key="invoice-10", depends_on=[middle]))
    else:
        child = broker.enqueue(new("child", idempotency_key="invoice-10", depends_on=[parent]))
    assert broker.get(child).state == "cancelled"
    if holder_is == "cancelled":
        other = broker.enqueue(new("other", idempotency_key="invoice-10"))
        assert broker.cancel([other], "ops", "hold")[other] == "cancelled"
    else:
        other = _dead(broker, "other", idempotency_key="invoice-10")
    ids = [parent, other] if order == "parent first" else [other, parent]
    assert broker.requeue(ids) == {parent: "queued", other: "queued"}
    got = broker.get(child)
    assert (got.state, got.reason, got.cancel_request["key_held_by"]) == ("cancelled", "parent_failed", other)
    assert broker.enqueue(new("third", idempotency_key="invoice-10")) == other
    jobs = claim_ids(broker)
    assert set(jobs) == {parent, other}
    broker.ack(jobs[other].lease)
    broker.ack(jobs[parent].lease)
    assert broker.get(child).state == "cancelled"  # its key was held when its parent reopened it: it never runs
    if holder_is == "a dead grandchild's key holder":
        assert set(claim_ids(broker)) == {middle}


# -- atomic enqueue, refusals ------------------------------------------------------

def test_a_workflow_is_stored_whole_or_not_at_all(broker):
    first = new("first").validate()
    second = new("second", depends_on=[first.id]).validate()
    broken = new("broken", depends_on=["job_00000000000000000000000000"])
    with pytest.raises(BadInput, match="unknown job job_0000"):
        broker.enqueue_many([first, second, broken])
    assert broker.get(first.id) is None and broker.get(second.id) is None
    assert claim_all(broker) == []
    ids = broker.enqueue_many([second, first])  # any order: parents are stored first
    assert ids == [second.id, first.id]
    assert broker.get(second.id).state == "waiting" and broker.get(first.id).state == "queued"


@pytest.mark.parametrize("edges", [
    "not a list", [42], [("job_x", "sometimes")], [("job_x",)], [["job_x", "success", 1]],
    # No job can have these ids: PostgreSQL failed the enqueue as an outage (BrokerError, "try
    # again") on the NUL, and Redis and PostgreSQL raised UnicodeEncodeError on the lone surrogate.
    ["job\x00x"], [("job\ud800x", "complete")],
])
def test_bad_dependencies_are_refused(broker, edges):
    with pytest.raises(BadInput, match="depends_on"):
        broker.enqueue(new(depends_on=edges))
    with pytest.raises(BadInput, match="depends_on"):
        broker.enqueue_many([new("parent", id="job_parent"),
                             new(depends_on=["job_parent", *edges] if isinstance(edges, list) else edges)])
    assert claim_all(broker) == []


def test_cycles_and_self_dependencies_are_refused(broker):
    a, b, c = new("a").validate(), new("b").validate(), new("c").validate()
    a.depends_on, b.depends_on, c.depends_on = [c.id], [a.id], [b.id]
    with pytest.raises(BadInput, match="cycle"):
        broker.enqueue_many([a, b, c, new("innocent")])
    me = new("me").validate()
    me.depends_on = [me.id]
    with pytest.raises(BadInput, match="depends on itself"):
        broker.enqueue(me)
    assert claim_all(broker) == []


# -- exactly once under concurrency -------------------------------------------------

GROUPS, MEMBERS = 40, 4


def _finisher(url, leases, start, done):
    """Finish this process's share of every group's members at the same instant as the others."""
    broker = open_broker(url)
    start.wait()
    for i, (job_id, token) in enumerate(leases):
        from supervisor.model import Lease

        lease = Lease(job_id, token)
        if i % 7 == 3:
            broker.dead(lease, "permanent", error_info("permanent"))
        else:
            broker.ack(lease, job_id)
    broker.close()
    done.put(len(leases))


def test_fan_in_is_released_exactly_once_by_four_concurrent_finishers(broker, broker_url):
    callbacks, members = [], []
    for g in range(GROUPS):
        group = [new("member", payload={"g": g, "m": m}).validate() for m in range(MEMBERS)]
        callback = new("callback", payload={"g": g}, depends_on=[(job.id, "complete") for job in group])
        broker.enqueue_many(group + [callback])
        callbacks.append(callback.id)
        members.append([job.id for job in group])
    leased = {job.id: job for job in broker.claim(Q, GROUPS * MEMBERS, 120, "main")}
    assert len(leased) == GROUPS * MEMBERS
    # Process m finishes member m of every group: each group's last two parents end at once.
    shares = [[(group[m], leased[group[m]].token) for group in members] for m in range(MEMBERS)]
    ctx = multiprocessing.get_context("fork")
    start, done = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_finisher, args=(broker_url, share, start, done)) for share in shares]
    for p in procs:
        p.start()
    start.set()
    assert sum(done.get(timeout=120) for _ in procs) == GROUPS * MEMBERS
    for p in procs:
        p.join(30)
    got = []
    while True:
        jobs = broker.claim(Q, 100, 30, "main")
        if not jobs:
            break
        got += jobs
    assert sorted(job.id for job in got) == sorted(callbacks), "every callback released exactly once"
    for job in got:
        assert job.pending == 0
        assert len(job.parents) == MEMBERS


# -- the producer API: chains, groups, batches ----------------------------------------

@pytest.fixture
def client(broker_url):
    from supervisor.client import Client

    with Client.from_url(broker_url) as c:
        yield c


def run_all(broker, handler):
    """Claim and finish every claimable job (handler returns the result, or raises to dead-letter)."""
    ran = []
    while True:
        jobs = claim_all(broker, 100)
        if not jobs:
            return ran
        for job in jobs:
            ran.append(job.type)
            try:
                result = handler(job)
            except Exception:  # noqa: BLE001 - the test's failing member
                die(broker, job)
            else:
                broker.ack(job.lease, result)


def test_a_chain_runs_in_order_and_passes_results(client, broker):
    ids = client.chain([("fetch", {"n": 2}), ("double", {}), ("double", {})])
    assert [broker.get(i).state for i in ids] == ["queued", "waiting", "waiting"]
    seen = []

    def step(job):
        seen.append(job.id)
        if job.type == "fetch":
            return job.payload["n"]
        ((_, result),) = [(s, r) for s, r in job.parents.values()]
        return result * 2

    run_all(broker, step)
    assert seen == ids
    assert broker.get(ids[-1]).result == 8


def test_a_group_callback_runs_once_after_every_member(client, broker):
    flow = client.group([("render", {"i": i}) for i in range(20)], then=("summary", {}))
    ran = run_all(broker, lambda job: job.payload.get("i"))
    assert ran.count("summary") == 1 and ran[-1] == "summary"
    summary = broker.get(flow.then)
    assert summary.state == "done"
    assert sorted(r for _, r in summary.parents.values()) == list(range(20))


@pytest.mark.parametrize("members,then,match", [
    ([], ("summary", {}), "empty group"),
    ("render", None, "must be a list"),
    ([("render", {})], 42, "then must be a job"),
    ([("render", {})], ("summary", "not a dict"), "then: payload must be a JSON object"),
    ([("render", {}), 7], None, "member 1 must be a job"),
    # Options that are no dict raised a raw TypeError ("'int' object is not iterable").
    ([("render", {}, 5)], None, "member 0: options must be a dict, got int"),
    ([("render", {})], ("summary", {}, "queue"), "then: options must be a dict, got str"),
])
def test_bad_groups_are_refused_and_store_nothing(client, broker, members, then, match):
    with pytest.raises(BadInput, match=match):
        client.group(members, then=then)
    assert claim_all(broker) == []


def test_a_steps_own_depends_on_joins_the_workflows_edges(client, broker):
    """A chain or group step may name parents of its own (its depends_on option): they join the
    edges the workflow gives it. They were dropped: the callback ran before a job it named, and an
    unknown id was never refused."""
    other = broker.enqueue(new("other", delay=3600))
    flow = client.group([("render", {})], then=("summary", {}, {"depends_on": [other]}))
    assert run_all(broker, lambda job: None) == ["render"]  # the callback waits for `other` too
    assert (broker.get(flow.then).state, broker.get(flow.then).pending) == ("waiting", 1)
    with pytest.raises(BadInput, match="nope"):
        client.chain([("a", {}, {"depends_on": ["nope"]}), ("b", {})])
    assert broker.stats(Q)["default"].ready == 0


def test_a_batch_counts_its_members_and_fires_each_callback_once(client, broker):
    from supervisor.workflows import batch_status

    batch = client.batch([("export", {"i": i}) for i in range(6)], on_success=("report", {}),
                         on_complete=("cleanup", {}))
    status = batch_status(broker, batch.id)
    assert (status.total, status.pending, status.done) == (6, 6, 0)

    def export(job):
        if job.payload.get("i") == 4:
            raise RuntimeError("customer 4 failed")
        return job.payload.get("i")

    ran = run_all(broker, export)
    status = batch_status(broker, batch.id)
    assert (status.total, status.pending, status.done, status.dead) == (6, 0, 5, 1)
    assert status.callback_state == "cancelled"  # on_success: a member failed
    assert ran.count("cleanup") == 1 and "report" not in ran
    # Replaying the dead member reopens the batch: on_success fires once, after it.
    dead = [m for m in batch.members if broker.get(m).state == "dead"]
    broker.dlq_replay(dead)
    assert batch_status(broker, batch.id).callback_state == "waiting"
    ran = run_all(broker, lambda job: "ok")
    assert ran == ["export", "report"]
    assert batch_status(broker, batch.id).done == 6
    assert broker.get(batch.on_complete).state == "done"  # ran once, not again


@pytest.mark.parametrize("steps", [{"type": "fetch", "payload": {}}, "fetch"])
def test_a_chain_given_one_job_or_a_string_names_that_not_a_letter_or_key(client, broker, steps):
    # Iterated, a dict gave its keys and a string its letters: "chain step 0 must be a job ..., got str".
    with pytest.raises(BadInput, match=f"a chain's steps must be a list of jobs, got {type(steps).__name__}"):
        client.chain(steps)
    assert claim_all(broker) == []


def test_a_batch_needs_a_callback(client):
    with pytest.raises(BadInput, match="on_success or on_complete"):
        client.batch([("export", {})])


@pytest.mark.parametrize("bad", [["job_x"], {"id": 1}, "\ud800", 5])
def test_batch_status_of_an_id_no_job_can_have_is_one_badinput_line(broker, bad):
    # SQLite answered a list with BrokerError (an outage: "try again") and a lone surrogate with
    # UnicodeEncodeError, Redis a list with a raw TypeError: the id is checked as client.get checks it.
    from supervisor.workflows import batch_status

    with pytest.raises(BadInput, match="job id must be a string"):
        batch_status(broker, bad)


# -- job control meets workflows: cancel and expiry cascade ------------------------------

def test_cancelling_a_parent_cancels_its_children_and_releases_complete_ones(broker):
    queued, running = broker.enqueue_many([new("a"), new("b", priority=5)])
    child_of_queued = broker.enqueue(new(depends_on=[queued]))
    complete_child = broker.enqueue(new("after", depends_on=[(running, "complete")]))
    lease = claim_all(broker, 1)[0].lease
    assert lease.job_id == running
    assert broker.cancel([queued, running], by="ops", reason="stop")[queued] == "cancelled"
    child = broker.get(child_of_queued)
    assert (child.state, child.reason) == ("cancelled", "parent_failed")
    assert child.cancel_request["by"] == "workflow" and child.cancel_request["reason"] == "parent_failed"
    assert broker.get(complete_child).state == "waiting"  # its parent is still running
    broker.cancelled(lease)
    assert broker.get(complete_child).state == "queued"
    assert broker.get(complete_child).parents == {running: ("cancelled", None)}


def test_cancelling_a_waiting_job_cascades_to_its_own_children(broker):
    root = broker.enqueue(new())
    middle = broker.enqueue(new(depends_on=[root]))
    leaf = broker.enqueue(new(depends_on=[middle]))
    assert broker.cancel([middle], by="ops", reason="no")[middle] == "cancelled"
    assert broker.get(leaf).state == "cancelled"
    broker.ack(claim_all(broker)[0].lease)  # the root still runs; nothing below it does
    assert claim_all(broker) == []


def test_an_expired_parent_cancels_its_success_children(broker):
    parent = broker.enqueue(new(expires_in=0.05))
    child = broker.enqueue(new(depends_on=[parent]))
    always = broker.enqueue(new(depends_on=[(parent, "complete")]))
    wait_for(lambda: broker.now() > broker.get(parent).expires_at, message="the parent's expiry to pass")
    got = claim_all(broker)
    assert [job.id for job in got] == [] or all(job.id == always for job in got)
    assert broker.get(parent).state == "expired"
    assert (broker.get(child).state, broker.get(child).reason) == ("cancelled", "parent_failed")
    assert broker.get(always).state in ("queued", "running")


def test_cancelling_a_batch_cancels_its_pending_jobs(client, broker):
    from supervisor.workflows import batch_status, cancel_batch

    batch = client.batch([("export", {"i": i}) for i in range(5)], on_success=("report", {}),
                         on_complete=("cleanup", {}))
    first = claim_all(broker, 1)[0]
    broker.ack(first.lease, 0)
    got = cancel_batch(client, batch, by="ops")
    assert sorted(got.values()) == ["cancelled"] * 6  # two callbacks, four pending members
    status = batch_status(broker, batch.id)
    assert (status.done, status.cancelled, status.pending, status.callback_state) == (1, 4, 0, "cancelled")
    assert broker.get(batch.on_complete).state == "cancelled"
    assert claim_all(broker) == []



@pytest.mark.parametrize("kind", ["sqlite", "redis", "postgres"])
def test_cancelling_a_batch_larger_than_one_cancel_call_cancels_all_of_it(kind, request):
    from supervisor.backends.control import MAX_IDS
    from supervisor.client import Client
    from supervisor.workflows import batch_status, cancel_batch

    with Client.from_url(request.getfixturevalue(f"{kind}_url")) as client:
        client.broker.migrate()
        batch = client.batch([("export", {"i": i}) for i in range(MAX_IDS)], on_success=("report", {}),
                             on_complete=("cleanup", {}))
        got = cancel_batch(client, batch, by="ops")  # 10,002 ids: more than one cancel call takes
        assert len(got) == MAX_IDS + 2 and set(got.values()) == {"cancelled"}
        status = batch_status(client.broker, batch.id)
        assert (status.cancelled, status.pending, status.callback_state) == (MAX_IDS, 0, "cancelled")
        assert client.get(batch.on_complete).state == "cancelled"  # the callbacks went first


# -- stats, retention ----------------------------------------------------------------

def test_stats_count_waiting_jobs(broker):
    parent = broker.enqueue(new())
    broker.enqueue_many([new(depends_on=[parent]) for _ in range(3)])
    assert (broker.stats(Q)["default"].waiting, broker.stats(Q)["default"].ready) == (3, 1)
    broker.ack(claim_all(broker)[0].lease)
    assert (broker.stats(Q)["default"].waiting, broker.stats(Q)["default"].ready) == (0, 3)


def test_prune_keeps_what_a_waiting_child_reads_and_removes_a_finished_workflow_whole(broker):
    early, late = broker.enqueue_many([new("early"), new("late", priority=-1)])
    child = broker.enqueue(new("child", depends_on=[early, late]))
    broker.ack(claim_all(broker, 1)[0].lease, "early result")
    broker.prune(0)  # the early parent may go: the child keeps its end and result
    broker.ack(claim_all(broker, 1)[0].lease, "late result")
    (got,) = claim_all(broker)
    assert got.parents == {early: ("done", "early result"), late: ("done", "late result")}
    broker.ack(got.lease)
    wait_for(lambda: broker.prune(0) >= 0 and broker.get(child) is None, message="the workflow to be pruned")
    assert broker.get(early) is None and broker.get(late) is None


def test_a_workflow_deeper_than_max_levels_is_refused_and_the_deepest_allowed_cascades(broker):
    from supervisor.dependencies import MAX_LEVELS

    chain = [new("root").validate()]
    for _ in range(MAX_LEVELS):
        chain.append(new("step", depends_on=[chain[-1].id]).validate())
    broker.enqueue_many(chain[:100])
    broker.enqueue_many(chain[100:])  # levels count across enqueues
    with pytest.raises(BadInput, match=f"level {MAX_LEVELS + 1} of its workflow, deeper than {MAX_LEVELS}"):
        broker.enqueue(new("too deep", depends_on=[chain[-1].id]))
    die(broker, claim_all(broker)[0])  # the longest cascade allowed fits in one write
    assert {broker.get(job.id).state for job in chain[1:]} == {"cancelled"}
    broker.dlq_replay([chain[0].id])  # and so does the longest reopening
    assert {broker.get(job.id).state for job in chain[1:]} == {"waiting"}


def test_a_waiting_job_holds_its_idempotency_key(broker):
    parent = broker.enqueue(new())
    child = broker.enqueue(new(idempotency_key="summary:11", depends_on=[parent]))
    # Were the key free while the child waits, this job would take it, and the child's release
    # (inside the parent's ack) would meet a second unfinished holder.
    assert broker.enqueue(new(idempotency_key="summary:11")) == child
    assert broker.enqueue_many([new(idempotency_key="summary:11", depends_on=[parent])]) == [child]
    broker.ack(claim_all(broker)[0].lease)
    assert broker.get(child).state == "queued"
    broker.ack(claim_all(broker)[0].lease)
    assert broker.enqueue(new(idempotency_key="summary:11")) != child  # finished: the key is free again


def test_a_child_requeued_with_its_parent_waits_for_it_whatever_the_order_of_the_ids(broker):
    """Named before its parent in one requeue, a child went back ``queued`` (its parent still
    dead at that moment) and ran beside it, reading the parent's old end. A parent named with
    its child now goes back first, on every broker; the answers keep the order given."""
    for order in ("child first", "parent first"):
        grand = broker.enqueue(new(delay=3600))
        parent = broker.enqueue(new(max_attempts=1))
        child = broker.enqueue(new(depends_on=[parent]))
        kid = broker.enqueue(new(depends_on=[child, grand]))
        die(broker, claim_ids(broker)[parent])
        assert broker.get(child).reason == "parent_failed"
        ids = [kid, child, parent] if order == "child first" else [parent, child, kid]
        answers = broker.requeue(ids)
        assert list(answers) == ids
        assert answers == {parent: "queued", child: "not_finished", kid: "not_finished"}, order
        assert [broker.get(i).state for i in (parent, child, kid)] == ["queued", "waiting", "waiting"], order
        assert list(claim_ids(broker)) == [parent], order
        broker.cancel([grand], "ops", "cleanup")


def test_a_dead_child_replayed_waits_for_a_parent_replayed_since_as_a_requeue_does(broker):
    """A child that ran and died after its parent ended, the parent replayed since: ``dlq_replay``
    of the child made it ``queued`` (it ran beside its parent, reading the parent's old end) where
    a requeue made it wait. A replay of a parent and its child in one call, child first, too."""
    for named in ("alone", "with its parent, child first"):
        parent = broker.enqueue(new(max_attempts=1))
        child = broker.enqueue(new(max_attempts=1, depends_on=[(parent, "complete")]))
        die(broker, claim_ids(broker)[parent])
        die(broker, claim_ids(broker)[child])
        if named == "alone":
            broker.dlq_replay([parent])
            assert broker.dlq_replay([child]) == [child]
        else:
            assert broker.dlq_replay([child, parent]) == [child, parent]
        got = broker.get(child)
        assert (got.state, got.pending, got.parents[parent]) == ("waiting", 1, (None, None)), named
        assert list(claim_ids(broker)) == [parent], named
        broker.ack(broker.get(parent).lease, "again")
        (again,) = claim_all(broker)
        assert again.id == child and again.parents == {parent: ("done", "again")}, named
        broker.ack(again.lease)


def test_a_replayed_chain_of_dead_jobs_runs_again_level_by_level(broker):
    """Three dead jobs of a chain replayed in one call, the last first: each waits for the one
    before it (PostgreSQL puts the children back a level a statement)."""
    top = broker.enqueue(new(max_attempts=1))
    mid = broker.enqueue(new(max_attempts=1, depends_on=[(top, "complete")]))
    leaf = broker.enqueue(new(max_attempts=1, depends_on=[(mid, "complete")]))
    for _ in range(3):
        die(broker, claim_all(broker)[0])
    assert broker.dlq_replay([leaf, mid, top]) == [leaf, mid, top]
    assert [(broker.get(i).state, broker.get(i).pending) for i in (top, mid, leaf)] == \
        [("queued", None), ("waiting", 1), ("waiting", 1)]
    for expected in (top, mid, leaf):
        (job,) = claim_all(broker)
        assert job.id == expected
        broker.ack(job.lease)


def test_a_job_stored_cancelled_in_a_batch_holds_no_idempotency_key(broker):
    """A child of a dead parent is stored ``cancelled``: it holds no key, so a later job of the
    same batch with its key is stored, and that job's own child waits for it, as two calls (and
    SQLite) do. Redis and PostgreSQL answered the later job with the cancelled one's id: it
    was never stored, and the child depending on it was cancelled too."""
    dead = broker.enqueue(new(max_attempts=1))
    die(broker, claim_ids(broker)[dead])
    born = new(idempotency_key="born-cancelled", depends_on=[dead]).validate()
    later = new(idempotency_key="born-cancelled").validate()
    kid = new(depends_on=[later.id]).validate()
    ids = broker.enqueue_many([born, later, kid])
    assert ids == [born.id, later.id, kid.id]
    states = [broker.get(i).state for i in ids]
    assert states == ["cancelled", "queued", "waiting"]
    assert broker.enqueue(new(idempotency_key="born-cancelled")) == later.id  # the later job holds it
    # The same batch sent again (its answer lost): its own jobs back. PostgreSQL looked up only
    # the ids a caller chose, and answered the cancelled job with the key's holder.
    assert broker.enqueue_many([born, later, kid]) == ids


def test_requeue_of_a_failed_parent_reopens_its_children(broker):
    parent = broker.enqueue(new())
    child = broker.enqueue(new(depends_on=[parent]))
    broker.cancel([parent], by="ops", reason="oops")
    assert broker.get(child).state == "cancelled"
    assert broker.requeue([parent]) == {parent: "queued"}
    assert broker.get(child).state == "waiting"
    broker.ack(claim_all(broker)[0].lease)
    assert [job.id for job in claim_all(broker)] == [child]


def test_a_requeued_child_waits_for_its_parents_not_finished_now(broker):
    """A child cancelled while its parents ran goes back ``waiting`` for the ones still unfinished,
    as a replay reopens a child: every broker made it ``queued``, so it ran before them, read
    ``(None, None)`` for each, and kept a stale ``pending``. A parent that died and was replayed
    while the child lay cancelled left its end recorded on the child: it is forgotten."""
    first, second, early = broker.enqueue_many([new(max_attempts=1), new(), new()])
    jobs = claim_ids(broker)
    broker.ack(jobs[early].lease, "early")
    child = broker.enqueue(new(depends_on=[first, second, early]))
    assert broker.cancel([child], "ops", "hold")[child] == "cancelled"
    die(broker, jobs[first])
    broker.dlq_replay([first])
    assert broker.requeue([child]) == {child: "waiting"}
    got = broker.get(child)
    assert (got.state, got.pending, got.parents[first]) == ("waiting", 2, (None, None))
    assert broker.stats(Q)["default"].waiting == 1
    assert list(claim_ids(broker)) == [first]  # the child is not claimable while they run
    broker.ack(broker.get(first).lease, "again")
    # Its failed-parent count was kept right: the other parent's failure and replay reopen it.
    die(broker, jobs[second])
    assert (broker.get(child).state, broker.get(child).reason) == ("cancelled", "parent_failed")
    broker.dlq_replay([second])
    assert broker.get(child).state == "waiting"
    broker.ack(claim_all(broker)[0].lease, "second")
    (got,) = claim_all(broker)
    assert got.id == child
    assert got.parents == {first: ("done", "again"), second: ("done", "second"), early: ("done", "early")}
    # With every parent finished, a requeue queues it at once.
    broker.dead(got.lease, "permanent", error_info("permanent", "Permanent", "no"))
    assert broker.requeue([child]) == {child: "queued"}
    assert [job.id for job in claim_all(broker)] == [child]


def test_a_child_is_not_requeued_to_run_while_an_on_success_parent_lies_failed(broker):
    """``tangguh retry --state cancelled`` made a callback cancelled ``parent_failed`` runnable while
    its parent lay dead: it ran without its parent ever succeeding. A requeue now answers
    ``parent_failed`` for a job with an ``on="success"`` parent that ended dead, cancelled or
    expired, and leaves it as it was; replaying that parent reopens it, as before."""
    parent = broker.enqueue(new(max_attempts=1))
    child = broker.enqueue(new(depends_on=[parent]))
    grandchild = broker.enqueue(new(depends_on=[child]))
    held = broker.enqueue(new(depends_on=[parent]))
    tolerant = broker.enqueue(new(depends_on=[(parent, "complete")]))
    assert broker.cancel([held], "ops", "hold")[held] == "cancelled"  # an operator's, before the death
    die(broker, claim_ids(broker)[parent])
    assert broker.get(child).reason == "parent_failed"
    # The grandchild's parent is cancelled, not dead: it fails it all the same.
    assert broker.requeue([child, grandchild, held]) == {
        child: "parent_failed", grandchild: "parent_failed", held: "parent_failed"}
    for kid in (child, grandchild):
        assert (broker.get(kid).state, broker.get(kid).reason) == ("cancelled", "parent_failed")
    assert broker.get(held).state == "cancelled"
    assert list(claim_ids(broker)) == [tolerant]  # on="complete": released by the death, as before
    assert broker.stats(Q)["default"].waiting == 0
    # The parent replayed reopens the child and its child; the one the operator cancelled can
    # now go back, waiting for the parent.
    assert broker.dlq_replay([parent]) == [parent]
    assert [broker.get(i).state for i in (child, grandchild)] == ["waiting", "waiting"]
    assert broker.requeue([held]) == {held: "waiting"}
    broker.ack(claim_ids(broker)[parent].lease, "at last")
    got = claim_ids(broker)
    assert set(got) == {child, held} and got[child].parents == {parent: ("done", "at last")}


def test_discarding_an_unfinished_parent_ends_it_for_its_children(broker):
    parent = broker.enqueue(new())
    child, always = broker.enqueue_many([new(depends_on=[parent]), new(depends_on=[(parent, "complete")])])
    assert broker.discard([parent]) == {parent: "discarded"}
    assert (broker.get(child).state, broker.get(child).reason) == ("cancelled", "parent_failed")
    assert broker.get(always).state == "queued"
    assert broker.get(always).parents == {parent: ("cancelled", None)}
    assert broker.discard([always]) == {always: "discarded"}  # a child goes with its edges
    assert broker.stats(Q)["default"].waiting == 0


def test_a_discarded_waiting_child_leaves_no_edge_for_a_new_job_of_its_id(broker):
    # An id the caller chose names a job again once the first is deleted: the deleted
    # child's parent ending must not settle the new job (Redis kept the edge on the parent).
    old_parent = broker.enqueue(new("parent", id="job_edge_old_parent"))
    broker.enqueue(new("child", id="job_edge_child", depends_on=[old_parent]))
    assert broker.discard(["job_edge_child"]) == {"job_edge_child": "discarded"}
    own_parent = broker.enqueue(new("parent", id="job_edge_own_parent", delay=3600))
    broker.enqueue(new("child", id="job_edge_child", depends_on=[own_parent]))
    broker.ack(claim_ids(broker)[old_parent].lease)
    child = broker.get("job_edge_child")
    assert (child.state, child.pending) == ("waiting", 1)
    assert child.parents == {own_parent: (None, None)}


def test_a_purged_or_pruned_child_leaves_no_edge_for_a_new_job_of_its_id(broker):
    # The same through the other deletions: a dead child purged, a done one pruned, and their
    # dead parent replayed (it ends a second time) after new jobs took their ids.
    parent = broker.enqueue(new("parent", id="job_edge_parent"))
    kids = ["job_edge_dead", "job_edge_done"]
    broker.enqueue_many([new("child", id=kid, depends_on=[(parent, "complete")]) for kid in kids])
    die(broker, claim_ids(broker)[parent])
    jobs = claim_ids(broker)
    die(broker, jobs["job_edge_dead"])
    broker.ack(jobs["job_edge_done"].lease)
    assert broker.dlq_purge(["job_edge_dead"]) == 1
    wait_for(lambda: broker.prune(0) >= 0 and broker.get("job_edge_done") is None, message="the done child pruned")
    own_parent = broker.enqueue(new("parent", id="job_edge_own_parent", delay=3600))
    broker.enqueue_many([new("child", id=kid, depends_on=[own_parent]) for kid in kids])
    assert broker.dlq_replay([parent]) == [parent]
    broker.ack(claim_ids(broker)[parent].lease)
    for kid in kids:
        child = broker.get(kid)
        assert (child.state, child.pending, child.parents) == ("waiting", 1, {own_parent: (None, None)}), kid


def test_members_an_idempotency_key_maps_to_one_stored_job_make_one_edge_of_the_callback(client, broker):
    """Two members with one key are one job, so the callback has one parent and fires once after
    it (Redis waited for ever, SQLite refused with a duplicate edge, PostgreSQL said "try again")."""
    flow = client.group([("render", {"i": 1}, {"idempotency_key": "inv-1"}),
                         ("render", {"i": 2}, {"idempotency_key": "inv-1"})], then=("summary", {}))
    assert flow.ids[0] == flow.ids[1]
    summary = broker.get(flow.then)
    assert (summary.state, summary.pending, summary.parents) == ("waiting", 1, {flow.ids[0]: (None, None)})
    assert run_all(broker, lambda job: job.payload.get("i")) == ["render", "summary"]
    assert broker.get(flow.then).parents == {flow.ids[0]: ("done", 1)}
    # A key naming a stored unfinished job the child also names: one edge, "success" winning.
    held = broker.enqueue(new("render", idempotency_key="inv-2"))
    member = new("render", idempotency_key="inv-2").validate()
    child = broker.enqueue_many([member, new("summary", depends_on=[(held, "complete"), member.id])])[1]
    assert (broker.get(child).pending, broker.get(child).parents) == (1, {held: (None, None)})
    die(broker, claim_ids(broker)[held])
    assert (broker.get(child).state, broker.get(child).reason) == ("cancelled", "parent_failed")


@pytest.mark.parametrize("flow", [False, True], ids=["plain", "workflow"])
def test_a_resend_of_a_job_it_named_returns_its_id_though_another_job_now_holds_its_key(broker, flow):
    """The id the caller chose is looked up before the key (docs/brokers.md "Job ids"): a client
    retrying an enqueue that landed, finished, and whose key a newer job took, gets its own job
    back, not that stranger (the brokers answered differently, and PostgreSQL per path)."""
    parent = broker.enqueue(new("parent"))
    resend = lambda: new("x", id="job_resent", idempotency_key="k-resent",  # noqa: E731
                         depends_on=[parent] if flow else None)
    assert broker.enqueue(resend()) == "job_resent"
    run_all(broker, lambda job: None)
    assert broker.get("job_resent").state == "done"
    holder = broker.enqueue(new("y", idempotency_key="k-resent"))
    assert broker.enqueue_many([resend()]) == ["job_resent"]
    assert broker.enqueue(resend()) == "job_resent"
    assert broker.enqueue(new("z", idempotency_key="k-resent")) == holder  # the key is still the holder's
    assert list(claim_ids(broker)) == [holder]


def test_a_deleted_parent_leaves_its_end_and_no_edge_for_a_new_job_of_its_id(broker):
    # A child keeps what its pruned or purged parent ended with while it waits for another; a new
    # job given that id (the caller chose it) is not that parent: its end and its replay must not
    # count for the child (SQLite and PostgreSQL matched the new job to the deleted parent's edges).
    done_p = broker.enqueue(new("parent", id="job_gone_done"))
    dead_p = broker.enqueue(new("parent", id="job_gone_dead"))
    other = broker.enqueue(new("other", id="job_gone_other", delay=3600))
    child = broker.enqueue(new("child", depends_on=[done_p, (dead_p, "complete"), other]))
    jobs = claim_ids(broker)
    broker.ack(jobs[done_p].lease, "old result")
    die(broker, jobs[dead_p])
    assert broker.dlq_purge([dead_p]) == 1
    wait_for(lambda: broker.prune(0) >= 0 and broker.get(done_p) is None, message="the done parent pruned")
    ends = {done_p: ("done", "old result"), dead_p: ("dead", None), other: (None, None)}

    def waits():
        got = broker.get(child)
        assert (got.state, got.pending, got.parents) == ("waiting", 1, ends)

    _, own_child = broker.enqueue_many([new("parent", id=done_p), new("own child", depends_on=[done_p])])
    broker.enqueue(new("plain", id=dead_p))
    jobs = claim_ids(broker)
    die(broker, jobs[done_p])
    die(broker, jobs[dead_p])
    waits()
    assert broker.dlq_replay([done_p, dead_p]) == [done_p, dead_p]
    waits()
    jobs = claim_ids(broker)
    broker.ack(jobs[done_p].lease, "new result")
    broker.ack(jobs[dead_p].lease, "new result")
    waits()
    assert broker.get(own_child).state == "queued"  # the new job's own child is released


def test_a_done_child_gone_by_retention_leaves_no_edge_for_a_new_job_of_its_id(broker_url):
    # Redis lets a done job's hash expire (done_ttl) without prune: the edge on its parent stayed.
    b = open_broker(broker_url + ("&done_ttl=1" if broker_url.startswith("redis") else ""))
    try:
        b.migrate()
        parent = b.enqueue(new("parent", id="job_ttl_parent"))
        b.enqueue(new("child", id="job_ttl_child", depends_on=[(parent, "complete")]))
        die(b, claim_ids(b)[parent])
        b.ack(claim_ids(b)["job_ttl_child"].lease)
        gone = (lambda: b.get("job_ttl_child") is None) if broker_url.startswith("redis") else (
            lambda: b.prune(0) >= 0 and b.get("job_ttl_child") is None)
        wait_for(gone, timeout=5, message="the done child gone")
        own_parent = b.enqueue(new("parent", id="job_ttl_own_parent", delay=3600))
        b.enqueue(new("child", id="job_ttl_child", depends_on=[own_parent]))
        assert b.dlq_replay([parent]) == [parent]
        b.ack(claim_ids(b)[parent].lease)
        child = b.get("job_ttl_child")
        assert (child.state, child.pending, child.parents) == ("waiting", 1, {own_parent: (None, None)})
    finally:
        b.close()


def test_prune_keeps_a_child_cancelled_by_a_parent_still_dead_until_that_parent_is_gone(broker):
    # The daemon prunes on its own: a callback cancelled by a dead member went before the member
    # was replayed, and the replay then never ran it. Kept while its parent can be replayed.
    ok, bad, purged = broker.enqueue_many([new("member"), new("member"), new("member")])
    callback = broker.enqueue(new("callback", depends_on=[ok, bad]))
    orphan = broker.enqueue(new("callback", depends_on=[purged]))
    jobs = claim_ids(broker)
    broker.ack(jobs[ok].lease, "ok result")
    die(broker, jobs[bad])
    die(broker, jobs[purged])
    wait_for(lambda: broker.prune(0) >= 0 and broker.get(ok) is None, message="the done member pruned")
    broker.prune(0)
    assert (broker.get(callback).state, broker.get(callback).reason) == ("cancelled", "parent_failed")
    assert broker.get(orphan).state == "cancelled"
    assert broker.dlq_purge([purged]) == 1  # its parent gone: the cancelled child follows retention
    wait_for(lambda: broker.prune(0) >= 0 and broker.get(orphan) is None, message="the orphan pruned")
    assert broker.dlq_replay([bad]) == [bad]
    assert broker.get(callback).state == "waiting"
    broker.ack(claim_ids(broker)[bad].lease, "bad result")
    (got,) = claim_all(broker)
    assert got.id == callback and got.parents == {ok: ("done", "ok result"), bad: ("done", "bad result")}


def test_a_parent_and_its_child_cancelled_in_one_call_end_in_the_order_given(broker):
    """Named after its parent, a waiting child is cancelled by the parent's end (parent_failed,
    answered already_cancelled) and a requeue of the parent reopens it; named before, the
    operator cancels it first. PostgreSQL cancelled both in one statement: the child ended the
    operator's, and stayed cancelled for good after the parent's requeue."""
    parent = broker.enqueue(new(delay=3600))
    child = broker.enqueue(new(depends_on=[parent]))
    assert broker.cancel([parent, child], "ops", "why") == {parent: "cancelled", child: "already_cancelled"}
    assert (broker.get(child).reason, broker.get(child).pending) == ("parent_failed", 0)
    assert broker.requeue([parent]) == {parent: "queued"}
    assert broker.get(child).state == "waiting"
    other = broker.enqueue(new(delay=3600))
    kid = broker.enqueue(new(depends_on=[other]))
    assert broker.cancel([kid, other], "ops", "why") == {kid: "cancelled", other: "cancelled"}
    assert broker.get(kid).reason is None and broker.get(kid).cancel_request["by"] == "ops"


def test_prune_removes_a_child_an_operator_cancelled_under_a_dead_parent(broker):
    """Only a child cancelled by its parent's failure (``parent_failed``) is kept for a replay;
    one an operator cancelled (no reason) follows retention. The SQL brokers kept it for as long
    as its parent lay dead: their test of the reason was NULL, and NOT NULL keeps a row."""
    parent = broker.enqueue(new(max_attempts=1))
    child = broker.enqueue(new(depends_on=[parent]))
    assert broker.cancel([child], "ops", "not needed")[child] == "cancelled"
    die(broker, claim_ids(broker)[parent])
    wait_for(lambda: broker.prune(0) >= 0 and broker.get(child) is None, message="the cancelled child pruned")
    assert broker.get(parent).state == "dead"


# -- the cost of reopening -----------------------------------------------------------

def _work(broker_url, broker, key, action):
    """What ``action`` costs the broker, in a unit that grows with the rows or fields it reads:
    SQLite's VM steps, PostgreSQL's tuples read in the transaction, Redis's whole reads of
    the hash ``key`` (its scripts' commands, seen by MONITOR)."""
    if broker_url.startswith("sqlite"):
        steps = [0]
        broker.db.set_progress_handler(lambda: steps.__setitem__(0, steps[0] + 1), 100)
        try:
            action()
        finally:
            broker.db.set_progress_handler(None, 100)
        return steps[0]
    if broker_url.startswith("redis"):
        import threading

        import redis
        seen, ready, mark = [], threading.Event(), f"ECHO end-of-{key}"

        def node():  # the server holding the queue's slot: a cluster's other nodes see none of it
            if broker_url.startswith("redis+cluster"):
                at = broker.r.get_node_from_key("{default}")
                return redis.Redis(host=at.host, port=at.port)
            return redis.Redis.from_url(broker_url.split("?")[0])

        def monitor():
            with node().monitor() as m:
                ready.set()
                for command in m.listen():
                    seen.append(command["command"])
                    if command["command"] == mark:
                        return
        watcher = threading.Thread(target=monitor, daemon=True)
        watcher.start()
        ready.wait(5)
        action()
        node().echo(f"end-of-{key}")
        watcher.join(10)
        return sum(1 for command in seen if command.startswith("HGETALL ") and command.endswith(f":j:{key}"))
    db = broker._conn()
    with db.transaction():
        db.execute("SELECT pg_stat_force_next_flush()")  # the counts below start from this transaction
    with db.transaction():
        # Every read by index, planned at each call: tables this small are otherwise scanned whole
        # (each statement reading every row stored), or not, as the planner's estimates go.
        db.execute("SET LOCAL enable_seqscan = off")
        db.execute("SET LOCAL plan_cache_mode = force_custom_plan")
        action()  # a savepoint in this transaction, whose table statistics are read before it ends
        (read,) = db.execute("SELECT sum(coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0))"
                             " FROM pg_stat_xact_user_tables WHERE schemaname = %s", (broker.schema,)).fetchone()
    return int(read)


def test_replaying_the_dead_members_of_a_big_fan_in_reads_the_callback_once_not_per_member(broker, broker_url):
    """Each replayed member's reopen read the whole callback (its edges or hash fields) to learn
    whether another member still failed it: a fan-in of 3,000 took 12-18 s in one script or
    transaction (Redis answered other clients BUSY). The work must grow linearly."""
    work = {}
    for n in (30, 240):
        members = broker.enqueue_many([new("member", {"i": i}) for i in range(n)])
        callback = broker.enqueue(new("callback", depends_on=members))
        for job in claim_all(broker, n):
            die(broker, job)
        work[n] = _work(broker_url, broker, callback, lambda: broker.dlq_replay(members))
        got = broker.get(callback)
        assert (got.state, got.pending) == ("waiting", n)
        broker.ack_many([(job.lease, None, None) for job in claim_all(broker, n)])
        assert [job.id for job in claim_all(broker)] == [callback]
    if broker_url.startswith("redis"):
        assert work == {30: 1, 240: 1}  # once, when the last member's replay reopens it
    else:
        assert work[240] < 12 * work[30], work  # 8 times the members; reading the callback each time: 20-40 times


def test_prune_keeps_the_whole_subtree_cancelled_under_a_parent_still_dead(broker):
    # P -> C -> G: C was kept (its parent lies dead) but G went (its parent is cancelled, not
    # dead), so the replay of P reopened C and not G. Kept down the tree; gone once P is.
    root, other = broker.enqueue_many([new("root"), new("root")])
    child = broker.enqueue(new("child", depends_on=[root]))
    grandchild = broker.enqueue(new("grandchild", depends_on=[child]))
    leaf = broker.enqueue(new("leaf", depends_on=[grandchild]))
    purged_child = broker.enqueue(new("child", depends_on=[other]))
    purged_grandchild = broker.enqueue(new("grandchild", depends_on=[purged_child]))
    jobs = claim_ids(broker)
    die(broker, jobs[root])
    die(broker, jobs[other])
    for job_id in (child, grandchild, leaf, purged_child, purged_grandchild):
        assert (broker.get(job_id).state, broker.get(job_id).reason) == ("cancelled", "parent_failed")
    broker.prune(0)
    broker.prune(0)
    for job_id in (child, grandchild, leaf, purged_child, purged_grandchild):
        assert broker.get(job_id) is not None, job_id
    assert broker.dlq_purge([other]) == 1  # the dead job gone: its subtree follows retention
    wait_for(lambda: broker.prune(0) >= 0 and broker.get(purged_grandchild) is None,
             message="the subtree of a purged job pruned")
    assert broker.get(purged_child) is None
    assert broker.dlq_replay([root]) == [root]
    assert [broker.get(j).state for j in (child, grandchild, leaf)] == ["waiting"] * 3
    for job_id, parent in ((root, None), (child, root), (grandchild, child), (leaf, grandchild)):
        (got,) = claim_all(broker)
        assert got.id == job_id and (parent is None or got.parents == {parent: ("done", parent)})
        broker.ack(got.lease, job_id)
    assert broker.get(leaf).state == "done"
