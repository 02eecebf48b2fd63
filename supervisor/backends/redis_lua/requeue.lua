-- requeue: ARGV[3..] = ids. Each dead, cancelled or expired job goes back queued,
-- due now, attempt 0, history kept (a child with parents not finished now: waiting for
-- them). Returns one outcome per id: 'queued', 'waiting', 'done',
-- 'not_finished', 'unknown', 'conflict' (an unfinished job holds its idempotency key) or
-- 'parent_failed' (an on="success" parent lies dead, cancelled or expired: left as it was).
-- A parent named with its child goes back first, so the child sees it unfinished and waits
-- for it (parents_first); the answers keep the order given.
local ids = {}
for k = 3, #ARGV do ids[#ids + 1] = ARGV[k] end
local order = parents_first(ids)
-- As in a replay: each job the call puts back holds its key before any child reopens, whatever
-- the order of the ids (a parent first let its child take the key, the holder then refused).
for _, id in ipairs(ids) do
  requeue_holds.call[id] = true
  local f = redis.call('HMGET', JOB .. id, 'state', 'idempotency_key', 'pending')
  if f[2] and (f[1] == 'dead' or f[1] == 'cancelled' or f[1] == 'expired')
      and not (f[3] and failed_parent(JOB .. id, id)) then
    requeue_holds.keys[f[2]] = true
  end
end

local out = {}
local any = false
for _, at in ipairs(order) do
  local id = ids[at]
  local key = JOB .. id
  local f = redis.call('HMGET', key, 'state', 'idempotency_key', 'priority', 'pending')
  local state = f[1]
  if not state then
    out[at] = 'unknown'
  elseif state == 'done' then
    out[at] = 'done'
  elseif state ~= 'dead' and state ~= 'cancelled' and state ~= 'expired' then
    out[at] = 'not_finished'
  elseif f[4] and failed_parent(key, id) then
    out[at] = 'parent_failed'
  else
    local holder = f[2] and redis.call('HGET', IDEM, f[2])
    local held = false
    if holder and holder ~= id then
      local hs = redis.call('HGET', JOB .. holder, 'state')
      held = hs == 'queued' or hs == 'running' or hs == 'retrying' or hs == 'waiting'
    end
    if held then
      out[at] = 'conflict'
    else
      -- A child waits again for its parents not finished now; 'pending' marks a child.
      local pending = f[4] and wait_again(key, id) or 0
      redis.call('HSET', key, 'state', pending > 0 and 'waiting' or 'queued', 'attempt', 0, 'run_at', NOW_SECS)
      if f[4] then redis.call('HSET', key, 'pending', pending) end
      redis.call('HDEL', key, 'reason', 'finished_at', 'lease_until', 'owner', 'open', 'cancel_request',
        'expires_at', 'progress', 'progress_note')
      for _, z in ipairs({DEAD, CANCELLED_Z, EXPIRED_Z, EXPIRING}) do redis.call('ZREM', z, id) end
      if f[2] then redis.call('HSET', IDEM, f[2], id) end
      if pending > 0 then
        redis.call('SADD', WAITING_S, id)
        out[at] = 'waiting'
      else
        make_ready(id, f[3] or 0, NOW)
        out[at] = 'queued'
        any = true
      end
      reopen(id)  -- workflows: the children it cancelled wait for it again
    end
  end
end
for _, child in ipairs(requeue_holds.children) do
  local ckey = JOB .. child
  local holder = redis.call('HGET', IDEM, redis.call('HGET', ckey, 'idempotency_key'))
  if holder and unfinished(redis.call('HGET', JOB .. holder, 'state')) then
    redis.call('HSET', ckey, 'cancel_request', '{"by":"workflow","reason":"parent_failed","at":'
      .. (redis.call('HGET', ckey, 'finished_at') or 'null') .. ',"key_held_by":' .. cjson.encode(holder) .. '}')
  end
end
if any then redis.call('PUBLISH', CHANNEL, '1') end
return out
