-- prune: ARGV[3] = age (us), ARGV[4] = batch size. Deletes up to a batch of done
-- (and of cancelled, of expired) jobs finished longer ago and sweeps a batch of the search index;
-- returns {jobs deleted, index entries removed}.
local cutoff = '(' .. num(NOW - tonumber(ARGV[3]))
local ids = redis.call('ZRANGEBYSCORE', DONE, '-inf', cutoff, 'LIMIT', 0, tonumber(ARGV[4]))
local deleted = 0
for _, id in ipairs(ids) do
  local queued = us_of(redis.call('HGET', JOB .. id, 'queued_at'))
  if queued then redis.call('ZREM', SEARCH, search_member(id, queued)) end
  deleted = deleted + redis.call('DEL', JOB .. id)
  redis.call('ZREM', DONE, id)
end
-- Cancelled and expired jobs are kept like done ones (their hashes have no TTL).
for _, z in ipairs({CANCELLED_Z, EXPIRED_Z}) do
  local ended = redis.call('ZRANGEBYSCORE', z, '-inf', cutoff, 'LIMIT', 0, tonumber(ARGV[4]))
  for _, id in ipairs(ended) do
    local queued = us_of(redis.call('HGET', JOB .. id, 'queued_at'))
    if queued then redis.call('ZREM', SEARCH, search_member(id, queued)) end
    deleted = deleted + redis.call('DEL', JOB .. id)
    redis.call('ZREM', z, id)
  end
  if #ended > #ids then ids = ended end  -- a full batch anywhere: prune calls again
end
-- Sweep a batch of the search index: entries of done jobs whose hash expired
-- (done_ttl) have no other way out. BASE..'search:sweep' remembers where it stopped.
local sweep = SEARCH .. ':sweep'
local from = redis.call('GET', sweep)
local members = redis.call('ZRANGEBYLEX', SEARCH, from and ('(' .. from) or '-', '+', 'LIMIT', 0, tonumber(ARGV[4]))
for _, m in ipairs(members) do
  if redis.call('EXISTS', JOB .. string.sub(m, 17)) == 0 then redis.call('ZREM', SEARCH, m) end
end
if #members < tonumber(ARGV[4]) then redis.call('DEL', sweep) else redis.call('SET', sweep, members[#members]) end
return {deleted, #ids}
