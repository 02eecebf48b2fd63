-- extend: ARGV[3] = lease (us), then id/token pairs. Pushes every current
-- lease to now + lease; returns the positions (1-based pairs) that are not current.
local until_us = NOW + tonumber(ARGV[3])
local lost = {}
local pos = 0
for k = 4, #ARGV, 2 do
  pos = pos + 1
  local id = ARGV[k]
  local key = JOB .. id
  if is_leased(key, ARGV[k + 1]) then
    redis.call('HSET', key, 'lease_until', secs(until_us))
    redis.call('ZADD', LEASED, until_us, id)
  else
    lost[#lost + 1] = pos
  end
end
return lost
