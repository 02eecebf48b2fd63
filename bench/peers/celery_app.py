"""Celery, prefork pool on Redis. ``BENCH_CELERY_MODE=acks_late`` selects the
documented at-least-once settings: ``task_acks_late`` +
``task_reject_on_worker_lost`` (+ ``worker_prefetch_multiplier=1``)."""
import os

from celery import Celery

from bench import work
from bench.peers import PEER_REDIS

app = Celery("bench", broker=PEER_REDIS)
app.conf.update(task_default_queue="bench", task_ignore_result=True, broker_connection_retry_on_startup=True,
                worker_hijack_root_logger=False)
if os.environ.get("BENCH_CELERY_MODE") == "acks_late":
    app.conf.update(task_acks_late=True, task_reject_on_worker_lost=True, worker_prefetch_multiplier=1)


@app.task(name="bench.run")
def run(kwargs):
    work.run(**kwargs)
