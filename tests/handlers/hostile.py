"""Handlers whose errors and results hold what storage and terminals choke on."""
import supervisor

UNSTORABLE = "nul \x00 and a lone \udc80 surrogate"


@supervisor.job("unstorable_error")
def unstorable_error(ctx, payload):
    raise ValueError(f"{UNSTORABLE} on attempt {ctx.job.attempt}")


@supervisor.job("deep_result")
def deep_result(ctx, payload):
    result = {}
    for _ in range(int(payload["depth"]) - 1):
        result = {"a": result}
    return result
