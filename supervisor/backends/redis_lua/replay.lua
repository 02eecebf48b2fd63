-- replay: ARGV[3..] = ids, all dead, or nothing changes.
-- Returns {'ok'}, {'notdead', id, state} or {'conflict', id}.
local keys = {}  -- two of these jobs with one key would both hold it: the second is refused
for k = 3, #ARGV do
  local id = ARGV[k]
  local f = redis.call('HMGET', JOB .. id, 'state', 'idempotency_key')
  if f[1] ~= 'dead' then return {'notdead', id, f[1] or 'unknown'} end
  if f[2] and keys[f[2]] then return {'conflict', id} end
  if f[2] then
    keys[f[2]] = true
    local holder = redis.call('HGET', IDEM, f[2])
    if holder and holder ~= id then
      local state = redis.call('HGET', JOB .. holder, 'state')
      if state == 'queued' or state == 'running' or state == 'retrying' or state == 'waiting' then
        return {'conflict', id}
      end
    end
  end
end
for k = 3, #ARGV do
  local id = ARGV[k]
  local key = JOB .. id
  redis.call('HSET', key, 'state', 'queued', 'attempt', 0, 'run_at', NOW_SECS)
  -- Run again by hand, like requeue: an expiry that passed while it lay dead is dropped.
  redis.call('HDEL', key, 'reason', 'finished_at', 'lease_until', 'owner', 'open', 'cancel_request', 'expires_at')
  redis.call('ZREM', DEAD, id)
  redis.call('ZREM', EXPIRING, id)
  local ikey = redis.call('HGET', key, 'idempotency_key')
  if ikey then redis.call('HSET', IDEM, ikey, id) end
  make_ready(id, redis.call('HGET', key, 'priority'), NOW)
  reopen(id)
end
redis.call('PUBLISH', CHANNEL, '1')
return {'ok'}
