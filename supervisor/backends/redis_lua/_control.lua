-- Job control's keys and helpers (prepended to every script after _common.lua).
-- In the queue's slot, beside the keys of _common.lua:
--   BASE..'cancelled'  zset  cancelled jobs by finish time (us)
--   BASE..'expired'    zset  expired jobs by finish time (us)
--   BASE..'expiring'   zset  unfinished jobs with an expires_at, by it (us): claim looks here
--   BASE..'paused'     string the pause ({"by","at"} JSON): no claim leases from the queue
-- A job hash's field "waited" asks for a message on CHANNEL..':done' (payload: its id) when
-- the job finishes: ``wait`` subscribes there; jobs nobody waits on publish nothing.
local QBASE = string.sub(JOB, 1, -3)
local CANCELLED_Z, EXPIRED_Z = QBASE .. 'cancelled', QBASE .. 'expired'
local EXPIRING, PAUSED = QBASE .. 'expiring', QBASE .. 'paused'

-- "1796101958.075713" (secs()) -> its microseconds, exactly.
local function us_of(text)
  local whole, frac = string.match(text or '', '^(%d+)%.?(%d*)$')
  if not whole then return nil end
  return tonumber(whole) * 1000000 + tonumber(string.sub(frac .. '000000', 1, 6))
end

local function tell_waiters(key, id)
  if redis.call('HEXISTS', key, 'waited') == 1 then redis.call('PUBLISH', CHANNEL .. ':done', id) end
end

local function append_entry(key, entry)
  local history = redis.call('HGET', key, 'history') or '[]'
  if history == '[]' then history = '[' .. entry .. ']'
  else history = string.sub(history, 1, -2) .. ',' .. entry .. ']' end
  redis.call('HSET', key, 'history', history)
end

-- A queued or retrying job leaves the ready and delayed zsets (run_at: its stored field).
local function unqueue(id, run_at)
  local run = us_of(run_at)
  if run then redis.call('ZREM', READY, string.format('%016.0f', run) .. id) end
  redis.call('ZREM', DELAYED, id)
end

-- An unfinished job with an expiry is looked at again by claim (after a retry, a release).
local function watch_expiry(key, id)
  local exp = us_of(redis.call('HGET', key, 'expires_at'))
  if exp then redis.call('ZADD', EXPIRING, exp, id) end
end

local function end_cancelled(key, id)
  redis.call('HSET', key, 'state', 'cancelled', 'finished_at', NOW_SECS)
  redis.call('HDEL', key, 'lease_until')
  redis.call('ZADD', CANCELLED_Z, NOW, id)
  redis.call('ZREM', EXPIRING, id)
  free_key(key, id)
  tell_waiters(key, id)
  settle(id, 'cancelled', nil)
end

-- expires_at (the hash's text) has passed: the job may no longer start.
local function past_expiry(expires_at)
  local exp = us_of(expires_at)
  return exp ~= nil and exp <= NOW
end

-- A due queued or retrying job, out of the ready and delayed zsets already, ends 'expired';
-- its hash is appended to `out` (the caller records it, never leases it).
local function end_expired(key, id, expires_at, out)
  redis.call('HSET', key, 'state', 'expired', 'finished_at', NOW_SECS)
  append_entry(key, '{"outcome":"expired","at":' .. NOW_SECS .. ',"expires_at":' .. expires_at .. '}')
  redis.call('ZADD', EXPIRED_Z, NOW, id)
  redis.call('ZREM', EXPIRING, id)
  free_key(key, id)
  tell_waiters(key, id)
  settle(id, 'expired', nil)
  out[#out + 1] = cjson.encode(redis.call('HGETALL', key))
end

-- The due jobs past their expires_at end 'expired' (at most 1000 per call: a larger backlog
-- is ended where the claim leases, by end_expired); their hashes are appended to `out`.
local function expire_due(out)
  local ids = redis.call('ZRANGEBYSCORE', EXPIRING, '-inf', num(NOW), 'LIMIT', 0, 1000)
  for _, id in ipairs(ids) do
    local key = JOB .. id
    local f = redis.call('HMGET', key, 'state', 'run_at', 'expires_at')
    local run = us_of(f[2])
    if (f[1] == 'queued' or f[1] == 'retrying') and run and run > NOW then
      redis.call('ZADD', EXPIRING, run, id)  -- not due yet: looked at again when it is
    elseif f[1] == 'queued' or f[1] == 'retrying' then
      unqueue(id, f[2])
      end_expired(key, id, f[3], out)
    else
      redis.call('ZREM', EXPIRING, id)  -- running or finished: a retry or release puts it back
    end
  end
end
