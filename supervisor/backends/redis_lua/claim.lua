-- claim: ARGV[3] = n, ARGV[4] = lease (us), ARGV[5] = owner, ARGV[6] = owner as JSON.
-- Reclaims this queue's expired leases, promotes due delayed jobs, ends the due
-- jobs past their expiry, then (unless the queue is paused) leases up to n ready jobs. Returns
-- one JSON array, an element per job (one reply to parse, not a bulk reply per job, let alone
-- ~25): an expired job's hash (HGETALL), a leased job's claimed_row.
local n, lease, owner, owner_json = tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5], ARGV[6]

local expired = redis.call('ZRANGEBYSCORE', LEASED, '-inf', '(' .. num(NOW), 'LIMIT', 0, 1000)
for _, id in ipairs(expired) do
  local key = JOB .. id
  redis.call('ZREM', LEASED, id)
  local f = redis.call('HMGET', key, 'attempt', 'max_attempts', 'owner', 'priority', 'cancel_request')
  if f[1] then
    local err = cjson.encode({reason = 'lease_expired', class = '', traceback = '',
      message = 'lease of owner ' .. tostring(f[3] or 'None') .. ' expired'})
    close_entry(key, ',"ended_at":' .. NOW_SECS .. ',"outcome":"lease_expired","error":' .. err)
    redis.call('HDEL', key, 'lease_until', 'owner')
    redis.call('HSET', key, 'error', err)
    failed_now(key)
    if f[5] then  -- a cancel asked of the lost attempt ends the job: it never starts again
      end_cancelled(key, id)
    elseif tonumber(f[1]) >= tonumber(f[2]) then
      redis.call('HSET', key, 'state', 'dead', 'reason', 'lease_expired', 'finished_at', NOW_SECS, 'run_at', NOW_SECS)
      redis.call('ZADD', DEAD, NOW, id)
      free_key(key, id)
      settle(id, 'dead', nil)
      tell_waiters(key, id)
    else
      redis.call('HSET', key, 'state', 'retrying', 'run_at', NOW_SECS)
      make_ready(id, f[4], NOW)
      watch_expiry(key, id)
    end
  end
end

local due = redis.call('ZRANGEBYSCORE', DELAYED, '-inf', num(NOW), 'WITHSCORES', 'LIMIT', 0, 1000)
for k = 1, #due, 2 do
  local id = due[k]
  redis.call('ZREM', DELAYED, id)
  local priority = redis.call('HGET', JOB .. id, 'priority')
  if priority then make_ready(id, priority, tonumber(due[k + 1])) end
end

-- Expired jobs (state 'expired': recorded, not leased) come first in the reply, and where a
-- popped job turns out past its expiry.
local out = {}
expire_due(out)
if n < 1 or redis.call('EXISTS', PAUSED) == 1 then return json_array(out) end
local popped = redis.call('ZPOPMIN', READY, n)
local until_us = NOW + lease
local until_text = secs(until_us)  -- every job of the call is leased until the same instant
for k = 1, #popped, 2 do
  local id = string.sub(popped[k], 17)
  local key = JOB .. id
  local v = redis.call('HMGET', key, unpack(ROW_FIELDS))  -- all of the row: lease_row needs no second read
  local state, expires = v[STATE_AT], v[EXPIRES_AT]
  if (state == 'queued' or state == 'retrying') and past_expiry(expires) then
    -- One of a backlog expire_due left (it ends 1000 per call): ended here, never leased.
    end_expired(key, id, expires, out)
  elseif state == 'queued' or state == 'retrying' then  -- never a job that ended meanwhile
    -- A started job cannot expire: out of the expiry index until a retry or release puts it
    -- back, or a finished job's entry would stay until its expires_at (up to ten years).
    if expires then redis.call('ZREM', EXPIRING, id) end
    redis.call('ZADD', LEASED, until_us, id)
    out[#out + 1] = lease_row(key, v, until_text, owner, owner_json)
  end
end
return json_array(out)
