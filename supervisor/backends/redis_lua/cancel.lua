-- cancel: ARGV[3] = by as JSON, [4] = reason as JSON, [5..] = ids.
-- A queued or retrying job ends cancelled; a running one gets the request
-- (the first one stands). Returns one answer per id (see Broker.cancel).
local by, reason = ARGV[3], ARGV[4]
local request = '{"by":' .. by .. ',"reason":' .. reason .. ',"at":' .. NOW_SECS .. '}'
local out = {}
for k = 5, #ARGV do
  local id = ARGV[k]
  local key = JOB .. id
  local f = redis.call('HMGET', key, 'state', 'run_at')
  local state = f[1]
  if not state then
    out[#out + 1] = 'unknown'
  elseif state == 'queued' or state == 'retrying' or state == 'waiting' then
    unqueue(id, f[2])
    redis.call('HSET', key, 'cancel_request', request)
    append_entry(key, '{"outcome":"cancelled","by":' .. by .. ',"reason":' .. reason .. ',"at":' .. NOW_SECS .. '}')
    end_cancelled(key, id)
    out[#out + 1] = 'cancelled'
  elseif state == 'running' then
    redis.call('HSETNX', key, 'cancel_request', request)
    out[#out + 1] = 'requested'
  else
    out[#out + 1] = 'already_' .. state
  end
end
return out
