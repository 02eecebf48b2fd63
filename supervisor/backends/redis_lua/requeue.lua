-- requeue: ARGV[3..] = ids. Each dead, cancelled or expired job goes back queued,
-- due now, attempt 0, history kept (a child with parents not finished now: waiting for
-- them). Returns one outcome per id: 'queued', 'waiting', 'done',
-- 'not_finished', 'unknown' or 'conflict' (an unfinished job holds its idempotency key).
-- A parent named with its child goes back first, so the child sees it unfinished and waits for
-- it (the ids in the order given wherever their edges allow: Kahn's algorithm). Answers by position.
local ids, pos = {}, {}
for k = 3, #ARGV do ids[#ids + 1] = ARGV[k]; pos[ARGV[k]] = #ids end
local indegree, kids, order = {}, {}, {}
for i, id in ipairs(ids) do
  indegree[i] = 0
  if #ids > 1 and redis.call('HEXISTS', JOB .. id, 'pending') == 1 then
    for _, name in ipairs(redis.call('HKEYS', JOB .. id)) do
      local p = string.sub(name, 1, 2) == 'd:' and pos[string.sub(name, 3)]
      if p and p ~= i then
        indegree[i] = indegree[i] + 1
        kids[p] = kids[p] or {}
        kids[p][#kids[p] + 1] = i
      end
    end
  end
end
local ready = {}
for i = #ids, 1, -1 do if indegree[i] == 0 then ready[#ready + 1] = i end end
while #ready > 0 do  -- a stack kept sorted: the smallest position on top
  local i = table.remove(ready)
  order[#order + 1] = i
  for _, c in ipairs(kids[i] or {}) do
    indegree[c] = indegree[c] - 1
    if indegree[c] == 0 then
      local at = #ready + 1
      while at > 1 and ready[at - 1] < c do at = at - 1 end
      table.insert(ready, at, c)
    end
  end
end
for i = 1, #ids do if indegree[i] > 0 then order[#order + 1] = i end end  -- no stored edges make a cycle

local out = {}
local any = false
for _, at in ipairs(order) do
  local id = ids[at]
  local key = JOB .. id
  local f = redis.call('HMGET', key, 'state', 'idempotency_key', 'priority', 'pending')
  local state = f[1]
  if not state then
    out[at] = 'unknown'
  elseif state == 'done' then
    out[at] = 'done'
  elseif state ~= 'dead' and state ~= 'cancelled' and state ~= 'expired' then
    out[at] = 'not_finished'
  else
    local holder = f[2] and redis.call('HGET', IDEM, f[2])
    local held = false
    if holder and holder ~= id then
      local hs = redis.call('HGET', JOB .. holder, 'state')
      held = hs == 'queued' or hs == 'running' or hs == 'retrying' or hs == 'waiting'
    end
    if held then
      out[at] = 'conflict'
    else
      -- A child waits again for its parents not finished now; 'pending' marks a child.
      local pending = f[4] and wait_again(key, id) or 0
      redis.call('HSET', key, 'state', pending > 0 and 'waiting' or 'queued', 'attempt', 0, 'run_at', NOW_SECS)
      if f[4] then redis.call('HSET', key, 'pending', pending) end
      redis.call('HDEL', key, 'reason', 'finished_at', 'lease_until', 'owner', 'open', 'cancel_request',
        'expires_at', 'progress', 'progress_note')
      for _, z in ipairs({DEAD, CANCELLED_Z, EXPIRED_Z, EXPIRING}) do redis.call('ZREM', z, id) end
      if f[2] then redis.call('HSET', IDEM, f[2], id) end
      if pending > 0 then
        redis.call('SADD', WAITING_S, id)
        out[at] = 'waiting'
      else
        make_ready(id, f[3] or 0, NOW)
        out[at] = 'queued'
        any = true
      end
      reopen(id)  -- workflows: the children it cancelled wait for it again
    end
  end
end
if any then redis.call('PUBLISH', CHANNEL, '1') end
return out
