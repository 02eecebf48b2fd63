"""Huey on Redis, defaults (results off: the jobs return nothing)."""
from huey import RedisHuey

from bench import work
from bench.peers import PEER_REDIS

huey = RedisHuey("bench", url=PEER_REDIS, results=False)


@huey.task()
def run(kwargs):
    work.run(**kwargs)
