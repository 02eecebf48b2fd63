"""Random workflows in the chaos soak: chains, groups with a callback, diamonds.

Their jobs are ordinary chaos jobs (the same handlers, idempotency keys and
effects), joined by ``depends_on`` edges, each edge ``on="success"`` or
``"complete"`` at random; a member is sometimes poison, so cancellation
cascades happen too. Each workflow is enqueued in one call with ids fixed in
advance, so a retry after a broker outage finds it stored (or stores it whole).

The invariants (``check``), from the broker's records:

* every workflow is stored whole: all of its jobs exist;
* no job waits forever: at rest no job is ``waiting``; every child whose
  parents all finished either ran (done or dead) or, when an ``on="success"``
  parent did not end ``done``, was cancelled with reason ``parent_failed``, and
  no child was cancelled otherwise;
* no child ran before all its parents finished: its first attempt started at
  or after the last parent's ``finished_at`` (the broker's clock);
* each child was released exactly once: its attempts never overlap (each
  starts after the previous one ended), and a done child committed its effect
  once (the soak's effect checks cover every done job).
"""
from supervisor.model import NewJob, new_job_id

SHAPES = ("chain", "group", "diamond")
KINDS = (("chaos.quick", 70), ("chaos.flaky", 15), ("chaos.slow", 10), ("chaos.poison", 5))


def make(rng, seed, count, max_attempts):
    """``count`` workflows: each a list of ``(key, kind, payload, attempts, [(parent key, on)], id)``."""
    out = []
    names, weights = zip(*KINDS)
    for w in range(count):
        shape = rng.choice(SHAPES)
        size = {"chain": rng.randint(2, 4), "group": rng.randint(3, 7), "diamond": 4}[shape]
        jobs = []
        for i in range(size):
            kind = rng.choices(names, weights)[0]
            payload = {"amount": rng.randint(1, 100), "acct": rng.randrange(16)}
            if kind == "chaos.slow":
                payload["secs"] = round(rng.uniform(0.05, 0.3), 3)
            elif kind == "chaos.flaky":
                payload["fails"] = 1
            elif kind == "chaos.poison":
                payload["permanent"] = True
            key = f"flow-{seed}-{w}-{i}"
            if shape == "chain":
                parents = [jobs[-1][0]] if jobs else []
            elif shape == "group":
                parents = [job[0] for job in jobs] if i == size - 1 else []  # the last is the callback
            else:
                parents = {0: [], 1: [jobs[0][0]] if jobs else [], 2: [jobs[0][0]] if jobs else [],
                           3: [jobs[1][0], jobs[2][0]] if len(jobs) > 2 else []}[i]
            deps = [(p, rng.choice(("success", "complete"))) for p in parents]
            jobs.append((key, kind, payload, 3 if kind == "chaos.poison" else max_attempts, deps, new_job_id()))
        out.append(jobs)
    return out


def enqueue(broker, workflow):
    """Store one workflow whole (a retry after an outage finds it stored); returns {key: id}."""
    ids = {key: job_id for key, *_, job_id in workflow}
    if broker.get(workflow[-1][-1]) is None:  # all or nothing: its last job stands for the whole
        broker.enqueue_many([NewJob(kind, payload, idempotency_key=key, max_attempts=attempts, id=job_id,
                                    depends_on=[(ids[p], on) for p, on in deps])
                             for key, kind, payload, attempts, deps, job_id in workflow])
    return ids


def check(check, workflows, jobs, cancelled_ids=frozenset()):
    """Add the workflow invariants to the soak's checks (``jobs``: key -> Job or None).

    ``cancelled_ids``: the jobs the soak's own random cancels reached; one of those may
    end ``cancelled`` by that request whatever its parents did (checked by the cancel
    invariants instead).
    """
    whole, waiting, wrong, early, overlapping = [], [], [], [], []
    for workflow in workflows:
        present = [jobs.get(key) is not None for key, *_ in workflow]
        if not all(present):
            whole.append((workflow[0][0], sum(present), len(present)))
            continue
        for key, _, _, _, deps, _ in workflow:
            job = jobs[key]
            if job.state == "waiting":
                waiting.append((key, job.id))
            if not deps:
                continue
            parents = [jobs[p] for p, _ in deps]
            failed = any(on == "success" and jobs[p].state != "done" for p, on in deps)
            if job.state == "cancelled" and job.id in cancelled_ids and job.reason != "parent_failed":
                pass  # the soak cancelled it itself
            elif failed != (job.state == "cancelled" and job.reason == "parent_failed") or (
                    not failed and job.state not in ("done", "dead")):
                wrong.append((key, job.state, job.reason, [(p, on, jobs[p].state) for p, on in deps]))
            starts = [h["started_at"] for h in job.history if "started_at" in h]
            last_parent = max((p.finished_at or 0) for p in parents)
            if starts and min(starts) < last_parent:
                early.append((key, min(starts), last_parent))
            attempts = [h for h in job.history if "started_at" in h]
            for before, after in zip(attempts, attempts[1:]):
                # A takeover closes one attempt and starts the next at the same instant, which
                # SQLite's JSON writes with fewer digits in one place than in the other.
                if before.get("ended_at") is None or after["started_at"] < before["ended_at"] - 1e-3:
                    overlapping.append((key, before.get("attempt"), after.get("attempt")))
    check("workflows: every workflow stored whole", not whole, f"{whole[:5]}")
    check("workflows: no job waits forever on finished parents", not waiting, f"{waiting[:5]}")
    check("workflows: each child ran, or was cancelled parent_failed exactly when an on=success parent failed",
          not wrong, f"{wrong[:3]}")
    check("workflows: no child started before all its parents finished", not early, f"{early[:5]}")
    check("workflows: each child released once (its attempts never overlap)", not overlapping, f"{overlapping[:5]}")


def cancelled_by_parent(workflows, jobs):
    """Keys of workflow children a failed parent cancelled: finished, though neither done nor dead."""
    return {key for workflow in workflows for key, *_ in workflow
            if jobs.get(key) is not None and jobs[key].state == "cancelled" and jobs[key].reason == "parent_failed"}
