"""A handler module that starts a thread when it is imported (a metrics or config client
does this), so the master would fork beside it."""
import threading

import supervisor

stop = threading.Event()
threading.Thread(target=stop.wait, name="config-refresher", daemon=True).start()


@supervisor.job("refreshed")
def refreshed(ctx, payload):
    return {"ok": True}
