-- enqueue: ARGV[3] = the jobs as one JSON array (one decode here beats ~20
-- arguments per job): [id, priority, delay_us, [field, value, ...], idempotency_key or false?,
-- expires_in_us?].
-- Returns the ids: an unfinished job's id where it holds the idempotency key.
-- KEYS[7], when given, is P:queues: the queue joins it here, in the same step as its jobs
-- (a cluster, where it lies in another slot, gets it in a round trip before: calls.py).
local jobs = cjson.decode(ARGV[3])
if KEYS[7] and jobs[1] then redis.call('SADD', KEYS[7], field_of(jobs[1][4], 'queue')) end
local ids = {}
local due_now = false
local typed = {}  -- types named in this call (index_job)
for n, job in ipairs(jobs) do
  local id, priority, delay, fields, ikey = job[1], job[2], job[3], job[4], job[5]
  local key = JOB .. id
  local holder = false
  if ikey then
    holder = redis.call('HGET', IDEM, ikey)
    if holder then
      local state = redis.call('HGET', JOB .. holder, 'state')
      if state ~= 'queued' and state ~= 'running' and state ~= 'retrying' and state ~= 'waiting' then
        holder = false
      end
    end
  end
  -- The id first: a resent call (client retry) gets its own job back, even when another job took
  -- its key after it finished (docs/brokers.md "Job ids"; every broker, every path).
  if redis.call('EXISTS', key) == 1 then
    ids[n] = id
  elseif holder then
    ids[n] = holder
  else
    local run = NOW + delay
    chosen_id_token(fields)
    redis.call('HSET', key, 'state', 'queued', 'attempt', 0, 'history', '[]',
      'run_at', secs(run), 'queued_at', NOW_SECS, unpack(fields))
    index_job(id, field_of(fields, 'type'), NOW, typed)
    if ikey then redis.call('HSET', IDEM, ikey, id) end
    if job[6] then  -- expires in (us), on this clock
      redis.call('HSET', key, 'expires_at', secs(NOW + job[6]))
      redis.call('ZADD', EXPIRING, NOW + job[6], id)
    end
    if delay > 0 then
      redis.call('ZADD', DELAYED, run, id)
    else
      make_ready(id, priority, run)
      due_now = true
    end
    ids[n] = id
  end
end
if due_now then redis.call('PUBLISH', CHANNEL, '1') end
return ids
