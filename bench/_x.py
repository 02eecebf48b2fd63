import time, redis, sys
from supervisor.backends import open_broker
url = "redis://127.0.0.1:6379/13?prefix=px"
r = redis.Redis.from_url("redis://127.0.0.1:6379/13"); r.flushdb()
b = open_broker(url); b.migrate()
n = int(sys.argv[1])
p = r.pipeline(transaction=False)
for i in range(n):
    p.sadd("px:queues", f"q{i}")
p.execute()
for k in range(3):
    t = time.perf_counter(); d = b.prune(7*86400, 10000); print(n, "names:", round(time.perf_counter()-t, 3), "s", d)
