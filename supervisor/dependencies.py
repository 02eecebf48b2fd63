"""Job dependencies: the edges a producer asks for, checked once for every broker.

A job with ``depends_on`` is stored ``waiting``. Each edge says what the
parent's end means for the child: ``on="success"`` (the default) runs the child
only if the parent ends ``done`` (a parent that ends dead, cancelled or expired
cancels the child with reason ``parent_failed``, and so on down the tree);
``on="complete"`` runs it whatever the outcome. The child becomes ``queued`` in
the same atomic write as its last parent's end (each broker's ``workflows``
module), so it is released exactly once whatever crashes.

What is refused here, before a broker is touched: an edge that is not an id or
an ``(id, on)`` pair, an unknown ``on``, a job depending on itself, and (in
``order``) a cycle among the jobs of one enqueue. A parent that is neither in
the same enqueue nor stored already is refused by the broker (``unknown``).
"""
import heapq

from .errors import BadInput
from .jsonvalues import is_storable

ON_SUCCESS, ON_COMPLETE = "success", "complete"
ONS = (ON_SUCCESS, ON_COMPLETE)
MAX_PARENTS = 100_000  # a group's callback waits on each member: bounded, but generous
PARENT_FAILED = "parent_failed"  # the reason a waiting child is cancelled with
# Added to that cancel_request when a replay leaves the child cancelled: the job named holds its
# idempotency key now (the child gave it up when cancelled), and that effect is already on its way.
KEY_HELD_BY = "key_held_by"
# Levels of a workflow: a job's level is 1 + its deepest parent's (0 without parents). A cancel
# cascades (and a replay reopens) one level per nested trigger on SQLite and PostgreSQL, whose
# nesting is bounded (SQLite: 1000 trigger levels; PostgreSQL: its stack): a bound here keeps
# every cascade inside them, so the write that ends a parent can never fail for its descendants.
MAX_LEVELS = 250


def level_of(job_id, parent_levels):
    """A child's level from its parents' (None counts as 0); BadInput past ``MAX_LEVELS``."""
    level = 1 + max((lv or 0 for lv in parent_levels), default=-1)
    if level > MAX_LEVELS:
        raise BadInput(f"job {job_id} would be level {level} of its workflow, deeper than {MAX_LEVELS}"
                       " (a chain that long: split it, enqueueing the rest from its last step)")
    return level


def cancelled_by_workflow(at):
    """The ``cancel_request`` stored on a job its failed parent cancelled."""
    return {"by": "workflow", "reason": PARENT_FAILED, "at": at}


def normalise(depends_on, job_id=None):
    """``depends_on`` as a list of ``(parent id, on)``, duplicates merged; BadInput naming what is wrong."""
    if depends_on is None:
        return []
    if isinstance(depends_on, (str, bytes)) or not isinstance(depends_on, (list, tuple)):
        raise BadInput(f"depends_on must be a list of job ids or (id, on) pairs, got {type(depends_on).__name__}")
    if len(depends_on) > MAX_PARENTS:
        raise BadInput(f"depends_on names {len(depends_on)} parents, more than {MAX_PARENTS}")
    edges = []
    for edge in depends_on:
        if isinstance(edge, str):
            parent, on = edge, ON_SUCCESS
        elif isinstance(edge, (list, tuple)) and len(edge) == 2 and isinstance(edge[0], str):
            parent, on = edge
        else:
            raise BadInput(f"depends_on: {edge!r} is neither a job id nor an (id, on) pair")
        if on not in ONS:
            raise BadInput(f"depends_on: on={on!r} for {parent} must be 'success' or 'complete'")
        # No job has an id with a NUL or a lone surrogate: asked for, PostgreSQL failed the
        # enqueue as an outage (BrokerError, "try again") and both servers' drivers raised
        # UnicodeEncodeError, where SQLite answered "unknown job".
        if not parent or len(parent) > 255 or not is_storable(parent):
            raise BadInput(f"depends_on: {parent!r} is not a job id")
        if parent == job_id:
            raise BadInput(f"job {job_id} depends on itself")
        edges.append((parent, on))
    return merged(edges)


def merged(edges):
    """``(parent, on)`` edges with each parent once, in first-seen order.

    A broker calls it again once idempotency keys have mapped parents to the
    jobs they are stored as: two members holding one key (or a member whose key
    an already-stored parent holds) are one parent, and a second edge to it
    would count it twice in ``pending`` (a callback that never fires) or break
    the edge table's key.
    """
    out = {}
    for parent, on in edges:
        # The same parent twice: "success" is the stricter wish and wins.
        out[parent] = ON_SUCCESS if out.get(parent) == ON_SUCCESS else on
    return list(out.items())


def order(jobs):
    """The jobs of one enqueue, each after its parents in the same enqueue; BadInput on a cycle.

    Jobs must be validated first (ids assigned, ``depends_on`` normalised).
    """
    if not any(job.depends_on for job in jobs):
        return list(jobs)
    position = {}
    for i, job in enumerate(jobs):
        if job.id in position:
            raise BadInput(f"job id {job.id} appears twice in one enqueue")
        position[job.id] = i
    edges = [(position[parent], i) for i, job in enumerate(jobs) for parent, _ in job.depends_on if parent in position]
    out = _positions_in_order(len(jobs), edges)
    if len(out) < len(jobs):
        stuck = sorted(jobs[i].id for i in set(range(len(jobs))) - set(out))
        raise BadInput(f"depends_on forms a cycle among {len(stuck)} jobs (e.g. {stuck[0]})")
    return [jobs[i] for i in out]


def parents_first(ids, edges):
    """``ids`` with each after its parents among them (``edges``: (parent id, child id) pairs), in the
    given order wherever the edges allow: a requeue puts a parent back before a child it names, so
    the child sees it unfinished and waits for it."""
    position = {job_id: i for i, job_id in enumerate(ids)}
    pairs = [(position[p], position[c]) for p, c in edges if p in position and c in position and p != c]
    if not pairs:
        return list(ids)
    out = _positions_in_order(len(ids), pairs)
    out += sorted(set(range(len(ids))) - set(out))  # stored edges make no cycle; were one there, no id is lost
    return [ids[i] for i in out]


def _positions_in_order(count, edges):
    """Positions ``0..count-1``, each after the ones ``edges`` ((before, after) pairs) put first, in
    position order wherever they allow. Kahn's algorithm on a heap of positions: no recursion (a
    chain of any length is fine). Positions on a cycle are left out."""
    indegree = [0] * count
    children = {}
    for before, after in edges:
        indegree[after] += 1
        children.setdefault(before, []).append(after)
    heap = [i for i, n in enumerate(indegree) if n == 0]
    heapq.heapify(heap)
    out = []
    while heap:
        i = heapq.heappop(heap)
        out.append(i)
        for child in children.get(i, ()):
            indegree[child] -= 1
            if indegree[child] == 0:
                heapq.heappush(heap, child)
    return out


def start(job, now):
    """One job's initial state, given its parents' in ``now`` ({id: (state, result, level)}: the
    stored jobs and the enqueue's earlier ones), which the job then joins.

    Returns ``(state, pending, edges, level)``, ``edges`` being ``(parent, on, state, result)``
    with state and result None while the parent is unfinished. A job is ``cancelled`` when an
    ``on="success"`` parent already failed (down the tree within the enqueue), ``waiting`` while
    parents are unfinished, ``queued`` otherwise. BadInput on a parent found nowhere.
    """
    from .model import FINISHED

    if not job.depends_on:
        now[job.id] = ("queued", None, 0)
        return "queued", None, [], 0
    pending, failed, edges = 0, False, []
    for parent, on in job.depends_on:
        if parent not in now:
            raise BadInput(f"job {job.id} depends on unknown job {parent}")
        state, result, _ = now[parent]
        if state in FINISHED:
            failed = failed or (on == ON_SUCCESS and state != "done")
            edges.append((parent, on, state, result))
        else:
            pending += 1
            edges.append((parent, on, None, None))
    state = "cancelled" if failed else "waiting" if pending else "queued"
    level = level_of(job.id, [now[parent][2] for parent, _ in job.depends_on])
    now[job.id] = (state, None, level)
    return state, pending, edges, level
