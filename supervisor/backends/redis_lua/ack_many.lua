-- ack_many: ARGV[3] = done TTL (s), ARGV[4] = the jobs, 4 values each: id, token, result JSON,
-- info body, every value followed by a NUL byte (none holds one: the rest is ASCII JSON, and
-- the client acks an id with one, stored by a release that did not refuse it, through ack.lua;
-- one argument, not four a job, is most of the client's packing).
-- Returns one '1' (acked) or '0' (the lease is not current) per job, in order, as one string:
-- ack.lua for a batch, so the supervisor stores every result of a loop turn in one call.
-- Per job, what ack.lua's helpers read one field at a time (is_leased, close_entry,
-- free_key, settle, tell_waiters) is read in one HMGET: half the calls per job.
local ttl = tonumber(ARGV[3])
local a, pos, list = {}, 1, ARGV[4]
while pos <= #list do
  local nul = string.find(list, '\0', pos, true)
  a[#a + 1] = string.sub(list, pos, nul - 1)
  pos = nul + 1
end
local out = {}
for i = 1, #a, 4 do
  local id, token = a[i], a[i + 1]
  local key = JOB .. id
  local v = redis.call('HMGET', key, 'state', 'token', 'history', 'open', 'idempotency_key', 'kids', 'waited')
  if v[1] == 'running' and v[2] == token then
    local history = closed_history(v[3], v[4], info_part(a[i + 3]) .. ',"ended_at":' .. NOW_SECS
      .. ',"outcome":"done"')
    redis.call('HSET', key, 'state', 'done', 'result', a[i + 2], 'finished_at', NOW_SECS, 'history', history)
    redis.call('HDEL', key, 'open', 'lease_until')
    redis.call('ZREM', LEASED, id)
    free_key_of(v[5], id)
    redis.call('EXPIRE', key, ttl)
    if v[6] then settle(id, 'done', a[i + 2]) end  -- a workflow's parent: its children hear of it
    if v[7] then redis.call('PUBLISH', CHANNEL .. ':done', id) end  -- tell_waiters
    redis.call('ZADD', DONE, NOW, id)
    out[#out + 1] = '1'
  else
    out[#out + 1] = '0'
  end
end
redis.call('ZREMRANGEBYSCORE', DONE, '-inf', '(' .. num(NOW - ttl * 1000000))
return table.concat(out)
