-- cancelled: ARGV[3] = id, [4] = token, [5] = info body. Ends a running job
-- cancelled (its handler stopped), fenced like dead.lua; the history entry
-- carries the stored request's by and reason.
local id, token = ARGV[3], ARGV[4]
local key = JOB .. id
if not is_leased(key, token) then return 0 end
local by, reason = 'null', 'null'
local request = redis.call('HGET', key, 'cancel_request')
if request then
  local r = cjson.decode(request)
  if type(r.by) == 'string' then by = cjson.encode(r.by) end
  if type(r.reason) == 'string' then reason = cjson.encode(r.reason) end
end
close_entry(key, info_part(ARGV[5]) .. ',"ended_at":' .. NOW_SECS .. ',"outcome":"cancelled","by":' .. by
  .. ',"reason":' .. reason)
redis.call('ZREM', LEASED, id)
end_cancelled(key, id)
return 1
