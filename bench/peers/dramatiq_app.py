"""Dramatiq on Redis, defaults (acks after the actor returns; unacked messages of a
dead worker are requeued by another worker's heartbeat maintenance)."""
import dramatiq
from dramatiq.brokers.redis import RedisBroker

from bench import work
from bench.peers import PEER_REDIS

broker = RedisBroker(url=PEER_REDIS)
dramatiq.set_broker(broker)


@dramatiq.actor(queue_name="bench", actor_name="bench_run")
def run(kwargs):
    work.run(**kwargs)
