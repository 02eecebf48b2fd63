-- prune: ARGV[3] = age (us), ARGV[4] = batch size, ARGV[5] = the done jobs' age (us; at most
-- done_ttl, while their hashes are there), ARGV[6] = the sweeps' batch size (ARGV[4] if not
-- given). Reads up to a batch of done, then cancelled, then expired jobs finished longer ago,
-- all three together, and deletes them (a cancelled one a replay may still need is kept);
-- sweeps a batch of the search index, one of the type indexes and one of the exclusive types'
-- resources; trims the queue's enqueue_once records older than the age; takes an empty queue's
-- name out of P:queues (KEYS[7], when given). Returns {jobs deleted, 1 if it read a whole batch
-- and took some of it out (more may follow) else 0, 1 if the queue has nothing left else 0}.
local SWEEP_N = tonumber(ARGV[6] or ARGV[4])
local unread = tonumber(ARGV[4])  -- entries of the three sets this call may still read
local removed = 0
local cutoff = '(' .. num(NOW - tonumber(ARGV[3]))
local done_cutoff = '(' .. num(NOW - tonumber(ARGV[5] or ARGV[3]))
redis.call('ZREMRANGEBYSCORE', QBASE .. 'once', '-inf', cutoff)
local ids = redis.call('ZRANGEBYSCORE', DONE, '-inf', done_cutoff, 'LIMIT', 0, unread)
local deleted = 0
unread, removed = unread - #ids, #ids
for _, id in ipairs(ids) do
  unindex_job(id, redis.call('HMGET', JOB .. id, 'queued_at', 'type'))
  unlink(JOB .. id, id)
  deleted = deleted + redis.call('UNLINK', JOB .. id)  -- a big hash (a group's callback) freed in the background
  redis.call('ZREM', DONE, id)
  redis.call('ZREM', EXPIRING, id)  -- an entry a claim of an older version left behind
end
-- A cancelled parent_failed parent going: the children it kept (``replayable``) count their
-- retention from their own end again, not from the prune that last kept them (a level a prune).
local function release_kept(key)
  local own = redis.call('HMGET', key, 'reason', 'kids')
  if own[1] ~= 'parent_failed' or not own[2] then return end
  local fields = redis.call('HGETALL', key)
  for i = 1, #fields, 2 do
    if string.sub(fields[i], 1, 2) == 'k:' then
      local child = string.sub(fields[i], 3)
      local c = redis.call('HMGET', JOB .. child, 'state', 'reason', 'finished_at')
      if c[1] == 'cancelled' and c[2] == 'parent_failed' and c[3] then
        redis.call('ZADD', CANCELLED_Z, 'XX', num(tonumber(c[3]) * 1000000), child)
      end
    end
  end
end
-- Cancelled and expired jobs are kept like done ones (their hashes have no TTL).
for _, z in ipairs({CANCELLED_Z, EXPIRED_Z}) do
  local ended = unread > 0 and redis.call('ZRANGEBYSCORE', z, '-inf', cutoff, 'LIMIT', 0, unread) or {}
  unread = unread - #ended
  for _, id in ipairs(ended) do
    if z == CANCELLED_Z and replayable(JOB .. id, id) then
      -- Kept: its retention counts again from now, so the prunes until then do not read it again.
      redis.call('ZADD', z, NOW, id)
    else
      if z == CANCELLED_Z then release_kept(JOB .. id) end
      unindex_job(id, redis.call('HMGET', JOB .. id, 'queued_at', 'type'))
      unlink(JOB .. id, id)
      deleted = deleted + redis.call('UNLINK', JOB .. id)  -- a big hash (a group's callback) freed in the background
      redis.call('ZREM', z, id)
      removed = removed + 1
    end
  end
end
-- Sweep a batch of the search index: entries of done jobs whose hash expired
-- (done_ttl) have no other way out. BASE..'search:sweep' remembers where it stopped.
local sweep = SEARCH .. ':sweep'
local from = redis.call('GET', sweep)
local members = redis.call('ZRANGEBYLEX', SEARCH, from and ('(' .. from) or '-', '+', 'LIMIT', 0, SWEEP_N)
for _, m in ipairs(members) do
  if redis.call('EXISTS', JOB .. string.sub(m, 17)) == 0 then redis.call('ZREM', SEARCH, m) end
end
if #members < SWEEP_N then redis.call('DEL', sweep) else redis.call('SET', sweep, members[#members]) end
-- The type indexes' entries of those jobs cannot be found from the queue's (the type left
-- with the hash): sweep a batch of them too, type after type in name order.
-- BASE..'search:types:sweep' {type, member} remembers where it stopped; a type whose
-- index is empty leaves BASE..'search:types'.
local tsweep = TYPES .. ':sweep'
local types = redis.call('SMEMBERS', TYPES)
table.sort(types)
local at = redis.call('HMGET', tsweep, 'type', 'member')
redis.call('DEL', tsweep)
local i, after = 1, false
if at[1] then
  while types[i] and types[i] < at[1] do i = i + 1 end
  if types[i] == at[1] then after = at[2] end  -- else that type left: the next one from its start
end
local budget = SWEEP_N
while types[i] and budget > 0 do
  local index = type_index(types[i])
  local got = redis.call('ZRANGEBYLEX', index, after and ('(' .. after) or '-', '+', 'LIMIT', 0, budget)
  for _, m in ipairs(got) do
    if redis.call('EXISTS', JOB .. string.sub(m, 17)) == 0 then redis.call('ZREM', index, m) end
  end
  budget = budget - #got
  if redis.call('EXISTS', index) == 0 then
    redis.call('SREM', TYPES, types[i])
    i, after = i + 1, false
  elseif budget == 0 then
    after = got[#got]
  else
    i, after = i + 1, false
  end
end
if types[i] then  -- the batch ran out: the next call starts here
  redis.call('HSET', tsweep, 'type', types[i])
  if after then redis.call('HSET', tsweep, 'member', after) end
end
-- The exclusive types' resource hashes (claim_limited.lua) gain a field per resource id ever
-- leased, and a field whose job is no longer running holds its resource no more: drop such
-- fields, a batch a call, type after type in name order. BASE..'excls:sweep' {type, cursor}
-- remembers where it stopped; a type whose hash is gone leaves BASE..'excls'.
local EXCLS = QBASE .. 'excls'
local esweep = EXCLS .. ':sweep'
local etypes = redis.call('SMEMBERS', EXCLS)
table.sort(etypes)
local eat = redis.call('HMGET', esweep, 'type', 'cursor')
redis.call('DEL', esweep)
local e, cursor = 1, '0'
if eat[1] then
  while etypes[e] and etypes[e] < eat[1] do e = e + 1 end
  if etypes[e] == eat[1] then cursor = eat[2] or '0' end
end
local left = SWEEP_N
while etypes[e] and left > 0 do
  local hash = QBASE .. 'excl:' .. etypes[e]
  local got = redis.call('HSCAN', hash, cursor, 'COUNT', left)
  local held = got[2]
  for k = 1, #held, 2 do
    if redis.call('HGET', JOB .. held[k + 1], 'state') ~= 'running' then redis.call('HDEL', hash, held[k]) end
  end
  left = left - math.max(1, #held / 2)  -- a scan step that found nothing still counts: the call ends
  cursor = got[1]
  if cursor == '0' then
    if redis.call('EXISTS', hash) == 0 then redis.call('SREM', EXCLS, etypes[e]) end
    e = e + 1
  end
end
if etypes[e] then redis.call('HSET', esweep, 'type', etypes[e], 'cursor', cursor) end
-- A queue with nothing left (_queue.lua) leaves P:queues, so that prune and the lookups that
-- walk every name stop visiting it, and queues() lists the queues with jobs, as on the SQL
-- brokers; a sweep's cursor left at the end of its last batch goes with it. Here when the set
-- is KEYS[7] (one server: an enqueue names the queue again in its own script); on a cluster
-- the caller takes it out (prune.py).
local empty = queue_empty()
if empty then redis.call('DEL', sweep, tsweep, esweep) end
if empty and KEYS[7] then redis.call('SREM', KEYS[7], string.match(JOB, '{([^{}]*)}:j:$')) end
-- More may follow a whole batch read; not when none of it could go (kept jobs alone), or a
-- caller going again at once would read the same ones (an age of 0) for ever.
return {deleted, (unread == 0 and removed > 0) and 1 or 0, empty and 1 or 0}
