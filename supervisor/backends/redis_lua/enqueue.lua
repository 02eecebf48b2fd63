-- enqueue: ARGV[3] = count, then per job: id, has_key (0/1), idempotency key,
-- priority, delay (us), nfields, field/value pairs. Returns the ids (an
-- existing unfinished job's id when the idempotency key is held).
local count = tonumber(ARGV[3])
local i = 4
local ids = {}
local due_now = false
for _ = 1, count do
  local id, has_key, ikey, priority, delay = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], tonumber(ARGV[i + 4])
  local nfields = tonumber(ARGV[i + 5])
  local first = i + 6
  i = first + nfields
  local key = JOB .. id
  local holder = false
  if has_key == '1' then
    holder = redis.call('HGET', IDEM, ikey)
    if holder then
      local state = redis.call('HGET', JOB .. holder, 'state')
      if state ~= 'queued' and state ~= 'running' and state ~= 'retrying' then holder = false end
    end
  end
  if holder then
    ids[#ids + 1] = holder
  elseif redis.call('EXISTS', key) == 1 then
    ids[#ids + 1] = id  -- a resent call (client retry): stored already
  else
    local run = NOW + delay
    local fields = {}
    for f = first, first + nfields - 1 do fields[#fields + 1] = ARGV[f] end
    redis.call('HSET', key, 'state', 'queued', 'attempt', 0, 'token', 0, 'history', '[]',
      'run_at', secs(run), 'queued_at', secs(NOW), unpack(fields))
    if has_key == '1' then redis.call('HSET', IDEM, ikey, id) end
    if delay > 0 then
      redis.call('ZADD', DELAYED, run, id)
    else
      make_ready(id, priority, run)
      due_now = true
    end
    ids[#ids + 1] = id
  end
end
if due_now then redis.call('PUBLISH', CHANNEL, ARGV[3]) end
return ids
