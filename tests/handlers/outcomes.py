"""Handlers whose outcomes are compared in-process (``run_jobs``) and under a real supervisor."""
import dataclasses
import time

import supervisor


@dataclasses.dataclass
class Greeting:
    name: str
    times: int = 1

    def __post_init__(self):
        if self.times < 1:
            raise ValueError("times must be at least 1")


@supervisor.job("greet", payload=Greeting)
def greet(ctx, payload):
    return {"hello": payload.name * payload.times}


@supervisor.job("flaky", max_attempts=3)
def flaky(ctx, payload):
    if ctx.job.attempt < payload["succeed_on"]:
        raise ConnectionError(f"attempt {ctx.job.attempt} failed")
    return {"attempt": ctx.job.attempt}


@supervisor.job("broken")
def broken(ctx, payload):
    raise supervisor.Permanent("this order does not exist")


@supervisor.job("slow", soft_timeout=0.2, timeout=10, max_attempts=1)
def slow(ctx, payload):
    time.sleep(5)


@supervisor.job("stuck", timeout=0.5, max_attempts=1)
def stuck(ctx, payload):
    while True:  # only the supervisor's hard timeout ends it
        pass



@supervisor.job("notify", queue="emails")
def notify(ctx, payload):
    return {"queue": ctx.job.queue}
