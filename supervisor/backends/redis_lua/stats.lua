-- stats (read only): ARGV[3] = done TTL (s).
-- Returns ready, scheduled, in_flight, dead, done, oldest ready age (us), cancelled, expired, paused (0/1).
local ttl = tonumber(ARGV[3])
local due_delayed = redis.call('ZCOUNT', DELAYED, '-inf', num(NOW))
local ready = redis.call('ZCARD', READY) + due_delayed
local scheduled = redis.call('ZCOUNT', DELAYED, '(' .. num(NOW), '+inf')
local oldest = nil
-- The oldest ready job heads one of the priority levels: visit each level's first member.
local head = redis.call('ZRANGE', READY, 0, 0, 'WITHSCORES')
local levels = 0
while head[1] and levels < 100 do
  local run = tonumber(string.sub(head[1], 1, 16))
  if not oldest or run < oldest then oldest = run end
  levels = levels + 1
  head = redis.call('ZRANGEBYSCORE', READY, '(' .. head[2], '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
end
if due_delayed > 0 then
  local first = redis.call('ZRANGE', DELAYED, 0, 0, 'WITHSCORES')
  local run = tonumber(first[2])
  if not oldest or run < oldest then oldest = run end
end
local age = 0
if oldest and oldest < NOW then age = NOW - oldest end
return {ready, scheduled, redis.call('ZCARD', LEASED), redis.call('ZCARD', DEAD),
  redis.call('ZCOUNT', DONE, '(' .. num(NOW - ttl * 1000000), '+inf'), num(age),
  redis.call('ZCARD', CANCELLED_Z), redis.call('ZCARD', EXPIRED_Z), redis.call('EXISTS', PAUSED)}
