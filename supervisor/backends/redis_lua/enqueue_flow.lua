-- enqueue_flow: ARGV[3] = a workflow's jobs as one JSON array, parents before
-- children: [id, priority, delay_us, [field, value, ...], idempotency_key or
-- false, expires_in_us or false, [[parent, on], ...]]. Every parent is in this call or stored in this
-- queue already. All or nothing: every parent is checked before anything is
-- written. Returns {'ok', ids...}, {'unknown', job id, parent id} or {'deep', job id, level}
-- (ARGV[4]: the most levels a workflow may have, dependencies.MAX_LEVELS), or {'once'}: ARGV[5],
-- when given, is enqueue_once's key for a job with parents, taken as enqueue_once.lua takes it,
-- once every check passed and before anything is written (a refused job leaves it unused).
local jobs = cjson.decode(ARGV[3])
local max_levels = tonumber(ARGV[4])
local stored, fresh, made, levels = {}, {}, {}, {}
local failed = {}  -- parent id -> whether it ended other than done (or is stored cancelled in this call)
for n, job in ipairs(jobs) do
  local id, ikey = job[1], job[5]
  local holder = false
  if ikey then
    holder = redis.call('HGET', IDEM, ikey)
    if holder then
      local state = redis.call('HGET', JOB .. holder, 'state')
      if state ~= 'queued' and state ~= 'running' and state ~= 'retrying' and state ~= 'waiting' then
        holder = false
      end
    end
    if not holder and made[ikey] then holder = made[ikey] end
  end
  -- The id first, as in enqueue.lua: a resent call gets its own job back, whoever holds its key now.
  if redis.call('EXISTS', JOB .. id) == 1 then
    stored[id] = id
  elseif holder then
    stored[id] = holder
  else
    stored[id] = id
    fresh[#fresh + 1] = job
    local level, born_cancelled = 0, false
    for _, dep in ipairs(job[7]) do
      local parent = stored[dep[1]] or dep[1]
      local plevel = levels[parent]
      if not plevel then
        local p = redis.call('HMGET', JOB .. parent, 'state', 'level')
        if not p[1] then return {'unknown', id, dep[1]} end
        plevel = tonumber(p[2] or '0')
        failed[parent] = p[1] == 'dead' or p[1] == 'cancelled' or p[1] == 'expired'
      end
      if plevel + 1 > level then level = plevel + 1 end
      born_cancelled = born_cancelled or (dep[2] == 'success' and failed[parent])
    end
    if level > max_levels then return {'deep', id, level} end
    levels[id] = level
    -- Stored cancelled (a parent already failed), it holds no key: a later job with it is stored.
    failed[id] = born_cancelled
    if ikey and not born_cancelled then made[ikey] = id end
  end
  fresh[id] = true
end

if ARGV[5] and redis.call('ZADD', string.sub(JOB, 1, -3) .. 'once', 'NX', NOW, ARGV[5]) == 0 then
  return {'once'}
end
-- KEYS[7], when given, is P:queues (as in enqueue.lua): the queue joins it before its jobs are written.
if KEYS[7] and jobs[1] then redis.call('SADD', KEYS[7], field_of(jobs[1][4], 'queue')) end
local due_now = false
local typed = {}  -- types named in this call (index_job)
for _, job in ipairs(fresh) do
  local id, priority, delay, fields, ikey, deps = job[1], job[2], job[3], job[4], job[5], job[7]
  local key = JOB .. id
  local run = NOW + delay
  local pending, failing, extra = 0, 0, {}
  -- Parents as stored: two that idempotency keys map to one job are one edge ("success" wins, as in
  -- dependencies.merged); counted twice in pending, the job would wait for ever.
  local edges, seen = {}, {}
  for _, dep in ipairs(deps) do
    local parent = stored[dep[1]] or dep[1]
    if not seen[parent] then
      edges[#edges + 1] = {parent, dep[2]}
      seen[parent] = #edges
    elseif dep[2] == 'success' then
      edges[seen[parent]][2] = 'success'
    end
  end
  for _, edge in ipairs(edges) do
    local parent, on = edge[1], edge[2]
    local pkey = JOB .. parent
    local f = redis.call('HMGET', pkey, 'state', 'result')
    extra[#extra + 1] = 'd:' .. parent
    extra[#extra + 1] = on
    if f[1] == 'done' or f[1] == 'dead' or f[1] == 'cancelled' or f[1] == 'expired' then
      if on == 'success' and f[1] ~= 'done' then failing = failing + 1 end
      extra[#extra + 1] = 'p:' .. parent
      extra[#extra + 1] = '["' .. f[1] .. '",' .. (f[2] or 'null') .. ']'
    else
      pending = pending + 1
    end
    redis.call('HSET', pkey, 'kids', '1', 'k:' .. id, on)
  end
  local state = 'queued'
  if failing > 0 then state = 'cancelled' elseif pending > 0 then state = 'waiting' end
  chosen_id_token(fields)
  redis.call('HSET', key, 'state', state, 'attempt', 0, 'history', '[]',
    'run_at', secs(run), 'queued_at', NOW_SECS, unpack(fields))
  index_job(id, field_of(fields, 'type'), NOW, typed)
  if #deps > 0 then
    redis.call('HSET', key, 'pending', pending, 'failing', failing, 'level', levels[id])
    for i = 1, #extra, 1000 do
      redis.call('HSET', key, unpack(extra, i, math.min(i + 999, #extra)))
    end
  end
  if job[6] then redis.call('HSET', key, 'expires_at', secs(NOW + job[6])) end
  if state == 'cancelled' then
    redis.call('HSET', key, 'reason', 'parent_failed', 'finished_at', NOW_SECS,
      'cancel_request', '{"by":"workflow","reason":"parent_failed","at":' .. NOW_SECS .. '}')
    redis.call('ZADD', CANCELLED_Z, NOW, id)
  else
    if state == 'waiting' then redis.call('SADD', WAITING_S, id) end
    if job[6] and state == 'queued' then redis.call('ZADD', EXPIRING, NOW + job[6], id) end
    if ikey then redis.call('HSET', IDEM, ikey, id) end  -- a waiting job holds its key too
    if state == 'queued' then
      if delay > 0 then
        redis.call('ZADD', DELAYED, run, id)
      else
        make_ready(id, priority, run)
        due_now = true
      end
    end
  end
end
if due_now then redis.call('PUBLISH', CHANNEL, '1') end
local out = {'ok'}
for n, job in ipairs(jobs) do out[n + 1] = stored[job[1]] end
return out
