"""Chains, groups and batches: workflows built on ``depends_on``, each enqueued in one atomic write.

    with Client.from_config() as client:
        client.chain([("fetch", {"url": u}), ("transform", {}), ("load", {})])
        flow = client.group([("render_invoice", {"id": i}) for i in ids],
                            then=("send_summary", {"month": "2026-11"}))
        batch = client.batch([("export", {"customer": c}) for c in customers],
                             on_success=("report", {}), on_complete=("cleanup", {}))

A step is what ``Client.enqueue_many`` takes: ``(type, payload)``,
``(type, payload, {options})`` or a dict of ``enqueue``'s arguments. Every
job of a workflow is stored, or none (``BadInput`` names what is wrong; a
broker error leaves nothing behind either). A step reads what came before it
with ``ctx.parents()`` (``ctx.parent_result()`` for a chain's previous step).

A batch is a group with callbacks: ``on_success`` runs once every member is
``done`` (it is cancelled, reason ``parent_failed``, when one fails; replaying
the dead member reopens it), ``on_complete`` runs once every member has
finished, whatever the outcome. The batch's record is its first callback's
dependencies: ``batch_status(broker, batch id)`` counts them.
"""
import collections
import dataclasses

from .backends.control import MAX_IDS, check_id
from .dependencies import ON_COMPLETE, ON_SUCCESS
from .errors import BadInput

Flow = collections.namedtuple("Flow", "ids then")  # a group: member ids, the callback's id (or None)


@dataclasses.dataclass(frozen=True)
class Batch:
    id: str  # the batch's record: the id of its first callback
    members: list
    on_success: str | None
    on_complete: str | None


@dataclasses.dataclass(frozen=True)
class BatchStatus:
    """What ``tangguh batch ID`` shows."""

    id: str
    total: int
    pending: int
    done: int
    dead: int
    cancelled: int
    expired: int
    callback_state: str

    def to_dict(self):
        return dataclasses.asdict(self)


def _step(client, item, what, depends_on=()):
    """A validated NewJob from one step; BadInput naming the step."""
    from .client import _job_args

    if not isinstance(item, (dict, tuple, list)):
        raise BadInput(f"{what} must be a job: (type, payload[, options]) or a dict, got {type(item).__name__}")
    try:
        args, options = _job_args(item)
        job = client.new_job(*args, **options)
        # The workflow's edges join the step's own (its depends_on option was dropped: a callback
        # ran before a job it named, and an unknown id in it was never refused).
        job.depends_on = [*job.depends_on, *depends_on]
        return job.validate()
    except BadInput as exc:
        raise BadInput(f"{what}: {exc}") from None


def chain(client, steps, on=ON_SUCCESS):
    """Each step depends on the previous one (``on``: "success", or "complete" to run on regardless)."""
    if isinstance(steps, (str, bytes, dict)):  # iterated: its letters or keys, "chain step 0 ... got str"
        raise BadInput(f"a chain's steps must be a list of jobs, got {type(steps).__name__}")
    try:
        steps = list(steps)
    except TypeError:  # chain(None): a TypeError, where every other bad input is one BadInput line
        raise BadInput(f"a chain's steps must be a list of jobs, got {type(steps).__name__}") from None
    if not steps:
        raise BadInput("a chain needs at least one step")
    jobs = []
    for i, item in enumerate(steps):
        jobs.append(_step(client, item, f"chain step {i}", [(jobs[-1].id, on)] if jobs else ()))
    return client.store(jobs)


def group(client, members, then=None, on=ON_SUCCESS):
    """Fan out ``members``; with ``then``, one callback that waits on every member (fan-in)."""
    jobs = _members(client, members, "group")
    if then is not None:
        jobs.append(_step(client, then, "the group's then", [(job.id, on) for job in jobs]))
    ids = client.store(jobs)
    return Flow(ids[:len(members)], ids[-1] if then is not None else None)


def batch(client, members, on_success=None, on_complete=None):
    """A group with an ``on_success`` and/or ``on_complete`` callback; its id is the first callback's."""
    if on_success is None and on_complete is None:
        raise BadInput("a batch needs on_success or on_complete (else it is a group)")
    jobs = _members(client, members, "batch")
    n = len(jobs)
    for what, callback, on in (("on_success", on_success, ON_SUCCESS), ("on_complete", on_complete, ON_COMPLETE)):
        if callback is not None:
            jobs.append(_step(client, callback, f"the batch's {what}", [(job.id, on) for job in jobs[:n]]))
    ids = client.store(jobs)
    success = ids[n] if on_success is not None else None
    complete = ids[-1] if on_complete is not None else None
    return Batch(success or complete, ids[:n], success, complete)


def _members(client, members, what):
    if not isinstance(members, (list, tuple)):
        raise BadInput(f"a {what}'s members must be a list of jobs, got {type(members).__name__}")
    if not members:
        raise BadInput(f"an empty {what}: give it at least one job")
    return [_step(client, item, f"{what} member {i}") for i, item in enumerate(members)]


def batch_status(broker, batch_id):
    """The counts of a batch (or of any job's dependencies); BadInput for an id that has none."""
    job = broker.get(check_id(batch_id))  # as Client.get: a list was an outage on SQLite, a TypeError on Redis
    if job is None or job.parents is None:
        raise BadInput(f"no batch {batch_id} (its id is the id of its first callback)")
    states = collections.Counter(state for state, _ in job.parents.values())
    return BatchStatus(batch_id, total=len(job.parents), pending=states[None], done=states["done"],
                       dead=states["dead"], cancelled=states["cancelled"], expired=states["expired"],
                       callback_state=job.state)


def cancel_batch(client, batch, by=None):
    """Cancel a batch's unfinished members and its callbacks: ``{job id: what happened}`` (``Broker.cancel``).

    ``batch``: a ``Batch`` (both callbacks are cancelled) or a batch id (its
    record's callback is; an ``on_complete`` that is not the record then runs,
    counting the cancellations, as it runs whatever the outcome). Running
    members are asked to stop; finished ones are left as they are.
    """
    batch_id = batch.id if isinstance(batch, Batch) else batch
    record = client.get(batch_id)
    if record is None or record.parents is None:
        raise BadInput(f"no batch {batch_id} (its id is the id of its first callback)")
    callbacks = [batch.on_success, batch.on_complete] if isinstance(batch, Batch) else [batch_id]
    # Callbacks first: a member cancelled before them would release an on_complete.
    pending = [job_id for job_id in callbacks if job_id] + [
        member for member, (state, _) in record.parents.items() if state is None]
    # A cancel call takes at most MAX_IDS ids and a batch may hold MAX_PARENTS members: one call for
    # them all refused a batch of 10,000 (BadInput, nothing cancelled). The first call holds the callbacks.
    out = {}
    for start in range(0, len(pending), MAX_IDS):
        out.update(client.cancel(pending[start:start + MAX_IDS], by=by, reason="batch cancelled"))
    return out
