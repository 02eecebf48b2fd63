-- dead: ARGV[3] = id, [4] = token, [5] = reason, [6] = error JSON, [7] = info body.
local id, token = ARGV[3], ARGV[4]
local key = JOB .. id
if not is_leased(key, token) then return 0 end
close_entry(key, info_part(ARGV[7]) .. ',"ended_at":' .. NOW_SECS .. ',"outcome":"dead","error":' .. ARGV[6])
redis.call('HSET', key, 'state', 'dead', 'reason', ARGV[5], 'error', ARGV[6], 'finished_at', NOW_SECS)
redis.call('HDEL', key, 'lease_until')
failed_now(key)
redis.call('ZREM', LEASED, id)
redis.call('ZADD', DEAD, NOW, id)
free_key(key, id)
settle(id, 'dead', nil)
tell_waiters(key, id)
return 1
