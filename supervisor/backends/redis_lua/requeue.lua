-- requeue: ARGV[3..] = ids. Each dead, cancelled or expired job goes back queued,
-- due now, attempt 0, history kept. Returns one outcome per id: 'queued', 'done',
-- 'not_finished', 'unknown' or 'conflict' (an unfinished job holds its idempotency key).
local out = {}
local any = false
for k = 3, #ARGV do
  local id = ARGV[k]
  local key = JOB .. id
  local f = redis.call('HMGET', key, 'state', 'idempotency_key', 'priority')
  local state = f[1]
  if not state then
    out[#out + 1] = 'unknown'
  elseif state == 'done' then
    out[#out + 1] = 'done'
  elseif state ~= 'dead' and state ~= 'cancelled' and state ~= 'expired' then
    out[#out + 1] = 'not_finished'
  else
    local holder = f[2] and redis.call('HGET', IDEM, f[2])
    local held = false
    if holder and holder ~= id then
      local hs = redis.call('HGET', JOB .. holder, 'state')
      held = hs == 'queued' or hs == 'running' or hs == 'retrying' or hs == 'waiting'
    end
    if held then
      out[#out + 1] = 'conflict'
    else
      redis.call('HSET', key, 'state', 'queued', 'attempt', 0, 'run_at', NOW_SECS)
      redis.call('HDEL', key, 'reason', 'finished_at', 'lease_until', 'owner', 'open', 'cancel_request',
        'expires_at', 'progress', 'progress_note')
      for _, z in ipairs({DEAD, CANCELLED_Z, EXPIRED_Z, EXPIRING}) do redis.call('ZREM', z, id) end
      if f[2] then redis.call('HSET', IDEM, f[2], id) end
      make_ready(id, f[3] or 0, NOW)
      reopen(id)  -- workflows: the children it cancelled wait for it again
      out[#out + 1] = 'queued'
      any = true
    end
  end
end
if any then redis.call('PUBLISH', CHANNEL, '1') end
return out
