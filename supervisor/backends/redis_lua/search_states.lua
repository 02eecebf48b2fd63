-- search_states: ARGV[3..] = state names among dead, done, cancelled, expired, running.
-- Returns the search-index members ("<16-digit queued_at us><id>") of the queue's jobs
-- in those states, read from the state's own sorted set (the caller checks its size first).
local sets = {dead = DEAD, done = DONE, cancelled = CANCELLED_Z, expired = EXPIRED_Z, running = LEASED}
local out = {}
for k = 3, #ARGV do
  for _, id in ipairs(redis.call('ZRANGE', sets[ARGV[k]], 0, -1)) do
    local q = us_of(redis.call('HGET', JOB .. id, 'queued_at'))
    if q then out[#out + 1] = search_member(id, q) end
  end
end
return out
