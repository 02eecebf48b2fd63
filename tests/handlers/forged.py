"""A handler that writes its own RESULT to the master's pipe: what a buggy or hostile
handler can do, since the child's pipe is reachable from its code."""
import supervisor
from supervisor.toolkit.connections import notify_master

# Every field the master computes with, each holding what no float or string takes.
FORGED = {"ok": False, "kind": ["not", "a", "kind"], "error_class": 7, "message": {"no": "text"},
          "traceback": None, "delay": 10 ** 400, "duration": "soon",
          "metrics": {"cache_hit": 10 ** 400, "lock_wait_seconds": float("nan"), 5: 1, "cache_miss": "many"}}


@supervisor.job("forges_its_result")
def forges_its_result(ctx, payload):
    if ctx.job.attempt == 1:
        notify_master(dict(FORGED, op="result", job_id=ctx.job.id, token=ctx.job.token))
    return {"attempt": ctx.job.attempt}


@supervisor.job("forges_a_tiny_duration")
def forges_a_tiny_duration(ctx, payload):
    """A RESULT of its own job that says it ran 5e-324 s: a float, finite, and the type's average
    run time then; the prefetch's budget over it is inf."""
    if ctx.job.attempt == 1:
        notify_master({"op": "result", "job_id": ctx.job.id, "token": ctx.job.token, "ok": True,
                       "duration": 5e-324})
    return {"attempt": ctx.job.attempt}


@supervisor.job("forges_a_lock")
def forges_a_lock(ctx, payload):
    """Lock messages whose TTL no float holds, is not a number at all, or is a float whose
    milliseconds no integer holds (1e306 s: inf ms)."""
    for ttl in (10 ** 400, float("inf"), float("nan"), -5, "soon", [1], 1e306):
        notify_master({"op": "lock", "key": f"forged:{ttl!r}", "token": "t", "ttl": ttl})
    return {"sent": True}
