-- enqueue_once: ARGV[3] = one job, as enqueue.lua takes a batch of them, with its
-- idempotency key. Prepended to enqueue.lua: enqueues the job unless its key was
-- ever enqueued through here (BASE..'once': zset key -> first use (us), trimmed by
-- prune); then returns false instead of the id.
if redis.call('ZADD', string.sub(JOB, 1, -3) .. 'once', 'NX', NOW, cjson.decode(ARGV[3])[1][5]) == 0 then
  return false
end
