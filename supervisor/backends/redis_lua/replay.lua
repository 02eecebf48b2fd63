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
-- As a requeue: a parent named with its child goes back first, and a child waits again for its
-- parents not finished now (one replayed since it died, say) rather than run before them.
local ids = {}
for k = 3, #ARGV do ids[#ids + 1] = ARGV[k] end
local order = parents_first(ids)
for _, at in ipairs(order) do
  local id = ids[at]
  local key = JOB .. id
  local child = redis.call('HEXISTS', key, 'pending') == 1
  local pending = child and wait_again(key, id) or 0
  redis.call('HSET', key, 'state', pending > 0 and 'waiting' or 'queued', 'attempt', 0, 'run_at', NOW_SECS)
  if child then redis.call('HSET', key, 'pending', pending) end
  -- Run again by hand, like requeue: an expiry that passed while it lay dead is dropped.
  redis.call('HDEL', key, 'reason', 'finished_at', 'lease_until', 'owner', 'open', 'cancel_request', 'expires_at')
  redis.call('ZREM', DEAD, id)
  redis.call('ZREM', EXPIRING, id)
  local ikey = redis.call('HGET', key, 'idempotency_key')
  if ikey then redis.call('HSET', IDEM, ikey, id) end
  if pending > 0 then
    redis.call('SADD', WAITING_S, id)
  else
    make_ready(id, redis.call('HGET', key, 'priority'), NOW)
  end
end
-- Every replayed job holds its key before any child reopens (as on PostgreSQL, whose triggers run
-- after the statement): a child reopened by one of them while another, later in the call, still lay
-- dead took that job's key, and the later one took it too: two unfinished holders of one key.
for _, at in ipairs(order) do reopen(ids[at]) end
redis.call('PUBLISH', CHANNEL, '1')
return {'ok'}
