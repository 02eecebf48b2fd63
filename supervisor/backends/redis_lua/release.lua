-- release: ARGV[3] = id, [4] = token. The attempt is given back, due now.
local id, token = ARGV[3], ARGV[4]
local key = JOB .. id
if not is_leased(key, token) then return 0 end
redis.call('HINCRBY', key, 'attempt', -1)
-- Nor was a rate spent: the token goes back (the next limited claim caps the bucket).
local bucket = QBASE .. 'rate:' .. redis.call('HGET', key, 'type')
if redis.call('EXISTS', bucket) == 1 then redis.call('HINCRBYFLOAT', bucket, 'tokens', 1) end
redis.call('HDEL', key, 'open', 'lease_until', 'owner')
redis.call('ZREM', LEASED, id)
if redis.call('HEXISTS', key, 'cancel_request') == 1 then  -- asked to cancel: it does not run again
  end_cancelled(key, id)
  return 1
end
watch_expiry(key, id)
redis.call('HSET', key, 'state', 'queued', 'run_at', NOW_SECS)
redis.call('ZREM', LEASED, id)
make_ready(id, redis.call('HGET', key, 'priority'), NOW)
redis.call('PUBLISH', CHANNEL, '1')
return 1
