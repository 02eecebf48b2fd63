-- ack: ARGV[3] = id, [4] = token, [5] = result JSON, [6] = info body, [7] = done TTL (s).
-- Returns 1, or 0 when the lease is not current.
local id, token, ttl = ARGV[3], ARGV[4], tonumber(ARGV[7])
local key = JOB .. id
if not is_leased(key, token) then return 0 end
close_entry(key, info_part(ARGV[6]) .. ',"ended_at":' .. NOW_SECS .. ',"outcome":"done"')
redis.call('HSET', key, 'state', 'done', 'result', ARGV[5], 'finished_at', NOW_SECS)
redis.call('HDEL', key, 'lease_until')
redis.call('ZREM', LEASED, id)
free_key(key, id)
redis.call('EXPIRE', key, ttl)
settle(id, 'done', ARGV[5])
tell_waiters(key, id)
-- The done zset indexes retained jobs by finish time; entries past the TTL
-- point at expired hashes and are trimmed here.
redis.call('ZADD', DONE, NOW, id)
redis.call('ZREMRANGEBYSCORE', DONE, '-inf', '(' .. num(NOW - ttl * 1000000))
return 1
