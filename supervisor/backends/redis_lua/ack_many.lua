-- ack_many: ARGV[3] = done TTL (s), then 4 values per job: id, token, result JSON, info body.
-- Returns one 1 (acked) or 0 (the lease is not current) per job, in order: ack.lua
-- for a batch, so the supervisor stores every result of a loop turn in one call.
local ttl = tonumber(ARGV[3])
local out = {}
for i = 4, #ARGV, 4 do
  local id, token = ARGV[i], ARGV[i + 1]
  local key = JOB .. id
  if is_leased(key, token) then
    close_entry(key, info_part(ARGV[i + 3]) .. ',"ended_at":' .. secs(NOW) .. ',"outcome":"done"')
    redis.call('HSET', key, 'state', 'done', 'result', ARGV[i + 2], 'finished_at', secs(NOW))
    redis.call('HDEL', key, 'lease_until')
    redis.call('ZREM', LEASED, id)
    free_key(key, id)
    redis.call('EXPIRE', key, ttl)
    tell_waiters(key, id)
    redis.call('ZADD', DONE, NOW, id)
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
redis.call('ZREMRANGEBYSCORE', DONE, '-inf', '(' .. num(NOW - ttl * 1000000))
return out
