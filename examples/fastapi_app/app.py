"""FastAPI recipe: one Tangguh client per app lifespan, enqueue from an endpoint, wait for a result.

    TANGGUH_CONFIG=tangguh.toml uvicorn app:app
"""
import asyncio
import contextlib
import os
import sys
import time

from fastapi import FastAPI, HTTPException, Request

import supervisor
from supervisor.model import FINISHED

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "handlers"))
from receipts import Receipt, send_receipt  # noqa: E402 - the producer imports the handler module


@contextlib.asynccontextmanager
async def lifespan(app):
    # From TANGGUH_CONFIG, else ./tangguh.toml or /etc/tangguh/config.toml (TANGGUH_BROKER_URL is not
    # read here: use Client.from_url for a bare URL); the connection opens on first use.
    with supervisor.Client.from_config(os.environ.get("TANGGUH_CONFIG")) as client:
        app.state.tangguh = client
        yield


app = FastAPI(lifespan=lifespan)


@app.post("/orders/{order_id}/receipt", status_code=202)
async def request_receipt(order_id: int, email: str, request: Request):
    try:
        job_id = send_receipt.enqueue(Receipt(order_id, email), client=request.app.state.tangguh,
                                      idempotency_key=f"receipt:{order_id}")
    except supervisor.BadInput as exc:
        raise HTTPException(422, str(exc)) from None
    return {"job_id": job_id}


@app.get("/jobs/{job_id}")
async def job_result(job_id: str, request: Request, timeout: float = 10.0):
    """The job once it is finished (done, dead, cancelled or expired); 504 if not within ``timeout`` seconds."""
    client = request.app.state.tangguh
    deadline = time.monotonic() + min(timeout, 30.0)
    while (job := client.get(job_id)) is not None and job.state not in FINISHED:
        if time.monotonic() > deadline:
            raise HTTPException(504, f"job {job_id} is still {job.state}")
        await asyncio.sleep(0.05)  # the event loop serves other requests meanwhile
    if job is None:
        raise HTTPException(404, f"no job {job_id}")
    return {"state": job.state, "result": job.result, "reason": job.reason}
