"""Handlers for the web console's browser tests: an export that reports progress and can be made to fail."""
import os
import time

import supervisor


@supervisor.job("export")
def export(ctx, payload):
    """Fails while the ``fail_while`` file exists (a dead letter to replay); returns a result holding a secret."""
    if payload.get("fail_while") and os.path.exists(payload["fail_while"]):
        raise ValueError(f"export failed for customer {payload.get('customer_id')}")
    ctx.progress(1.0, "written")
    return {"rows": 3, "card_number": payload.get("card_number")}


@supervisor.job("long_export", timeout=120)
def long_export(ctx, payload):
    """Reports progress until cancelled (bounded by ``max_wait``)."""
    deadline = time.monotonic() + float(payload.get("max_wait", 60))
    step = 0
    while time.monotonic() < deadline and not ctx.cancelled():
        step += 1
        ctx.progress(min(0.99, step / 1000), f"row {step}")
        time.sleep(0.02)
    return {"rows": step}
