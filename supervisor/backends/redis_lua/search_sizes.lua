-- search_sizes (read only): ARGV[3..] = state names among dead, done, cancelled, expired,
-- running. Returns the total size of those states' sorted sets in the queue.
local sets = {dead = DEAD, done = DONE, cancelled = CANCELLED_Z, expired = EXPIRED_Z, running = LEASED}
local n = 0
for k = 3, #ARGV do n = n + redis.call('ZCARD', sets[ARGV[k]]) end
return n
