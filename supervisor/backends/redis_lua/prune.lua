-- prune: ARGV[3] = age (us), ARGV[4] = batch size. Deletes up to a batch of done
-- jobs finished longer ago; returns {jobs deleted, index entries removed}.
local cutoff = '(' .. num(NOW - tonumber(ARGV[3]))
local ids = redis.call('ZRANGEBYSCORE', DONE, '-inf', cutoff, 'LIMIT', 0, tonumber(ARGV[4]))
local deleted = 0
for _, id in ipairs(ids) do
  deleted = deleted + redis.call('DEL', JOB .. id)
  redis.call('ZREM', DONE, id)
end
-- Cancelled and expired jobs are kept like done ones (their hashes have no TTL).
for _, z in ipairs({CANCELLED_Z, EXPIRED_Z}) do
  local ended = redis.call('ZRANGEBYSCORE', z, '-inf', cutoff, 'LIMIT', 0, tonumber(ARGV[4]))
  for _, id in ipairs(ended) do
    deleted = deleted + redis.call('DEL', JOB .. id)
    redis.call('ZREM', z, id)
  end
  if #ended > #ids then ids = ended end  -- a full batch anywhere: prune calls again
end
return {deleted, #ids}
