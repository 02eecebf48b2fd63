-- search_page: ARGV[3], ARGV[4] = lexicographic bounds of the search index
-- (min, max), ARGV[5] = 'newest' or 'oldest', ARGV[6] = at most this many entries,
-- ARGV[7] = '' to read the queue's index, or a type to read that type's index,
-- ARGV[8..] = the job fields to return. Returns {member, field values..., member, ...};
-- a job whose hash is gone (an expired done job) has its entry removed (from the type's
-- index too when that is the one read) and 'false' values.
local index = SEARCH
if ARGV[7] ~= '' then index = type_index(ARGV[7]) end
local entries
if ARGV[5] == 'newest' then
  entries = redis.call('ZREVRANGEBYLEX', index, ARGV[4], ARGV[3], 'LIMIT', 0, tonumber(ARGV[6]))
else
  entries = redis.call('ZRANGEBYLEX', index, ARGV[3], ARGV[4], 'LIMIT', 0, tonumber(ARGV[6]))
end
local fields = {}
for k = 8, #ARGV do fields[#fields + 1] = ARGV[k] end
local out = {}
for _, m in ipairs(entries) do
  out[#out + 1] = m
  if #fields > 0 then
    local v = redis.call('HMGET', JOB .. string.sub(m, 17), unpack(fields))
    if not v[1] and redis.call('EXISTS', JOB .. string.sub(m, 17)) == 0 then
      redis.call('ZREM', SEARCH, m)
      if index ~= SEARCH then redis.call('ZREM', index, m) end
    end
    for k = 1, #fields do out[#out + 1] = v[k] end
  end
end
return out
