-- discard: ARGV[3..] = ids. Deletes each job that is not running, from its hash
-- and every index. Returns one outcome per id: 'discarded', 'running' or 'unknown'.
local out = {}
for k = 3, #ARGV do
  local id = ARGV[k]
  local key = JOB .. id
  local f = redis.call('HMGET', key, 'state', 'queued_at', 'run_at')
  if not f[1] then
    out[#out + 1] = 'unknown'
  elseif f[1] == 'running' then
    out[#out + 1] = 'running'
  else
    local run = micros(f[3])
    if run then redis.call('ZREM', READY, string.format('%016.0f', run) .. id) end
    redis.call('ZREM', DELAYED, id)
    redis.call('ZREM', DEAD, id)
    redis.call('ZREM', DONE, id)
    local queued = micros(f[2])
    if queued then redis.call('ZREM', SEARCH, search_member(id, queued)) end
    free_key(key, id)
    redis.call('DEL', key)
    out[#out + 1] = 'discarded'
  end
end
return out
