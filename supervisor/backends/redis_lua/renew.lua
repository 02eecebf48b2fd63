-- renew: ARGV[3] = lease (us), then 4 values per lease: id, token, progress fraction
-- ('' for none), progress note ('' for none). extend.lua that also stores progress on
-- current leases and answers their cancel requests.
-- Returns {positions (1-based) not current, {id, cancel request JSON, ...}}.
local until_us = NOW + tonumber(ARGV[3])
local lost, cancel = {}, {}
local pos = 0
for k = 4, #ARGV, 4 do
  pos = pos + 1
  local id = ARGV[k]
  local key = JOB .. id
  if is_leased(key, ARGV[k + 1]) then
    redis.call('HSET', key, 'lease_until', secs(until_us))
    redis.call('ZADD', LEASED, until_us, id)
    if ARGV[k + 2] ~= '' then
      redis.call('HSET', key, 'progress', ARGV[k + 2])
      if ARGV[k + 3] ~= '' then redis.call('HSET', key, 'progress_note', ARGV[k + 3])
      else redis.call('HDEL', key, 'progress_note') end
    end
    local request = redis.call('HGET', key, 'cancel_request')
    if request then
      cancel[#cancel + 1] = id
      cancel[#cancel + 1] = request
    end
  else
    lost[#lost + 1] = pos
  end
end
return {lost, cancel}
