-- prune: ARGV[3] = age (us), ARGV[4] = batch size. Deletes up to a batch of done
-- jobs finished longer ago; returns {jobs deleted, index entries removed}.
local cutoff = '(' .. num(NOW - tonumber(ARGV[3]))
local ids = redis.call('ZRANGEBYSCORE', DONE, '-inf', cutoff, 'LIMIT', 0, tonumber(ARGV[4]))
local deleted = 0
for _, id in ipairs(ids) do
  deleted = deleted + redis.call('DEL', JOB .. id)
  redis.call('ZREM', DONE, id)
end
return {deleted, #ids}
