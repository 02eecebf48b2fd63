-- retry: ARGV[3] = id, [4] = token, [5] = run_at (us), [6] = error JSON, [7] = info body.
local id, token, run = ARGV[3], ARGV[4], tonumber(ARGV[5])
local key = JOB .. id
if not is_leased(key, token) then return 0 end
close_entry(key, info_part(ARGV[7]) .. ',"ended_at":' .. NOW_SECS .. ',"outcome":"retry","error":' .. ARGV[6])
redis.call('HSET', key, 'error', ARGV[6])
failed_now(key)
redis.call('ZREM', LEASED, id)
if redis.call('HEXISTS', key, 'cancel_request') == 1 then  -- asked to cancel: it does not run again
  end_cancelled(key, id)
  return 1
end
redis.call('HSET', key, 'state', 'retrying', 'run_at', secs(run))
redis.call('HDEL', key, 'lease_until')
watch_expiry(key, id)
if run <= NOW then
  make_ready(id, redis.call('HGET', key, 'priority'), run)
  redis.call('PUBLISH', CHANNEL, '1')
else
  redis.call('ZADD', DELAYED, run, id)
end
return 1
