-- Workflows (prelude part, after _common.lua). A child and its parents share
-- the queue, so every key here is in the script's slot. In a job's hash:
--   kids        "1" once some job depends on it
--   k:<child>   the edge's "on" (success | complete), on the parent
--   d:<parent>  the edge's "on", on the child
--   p:<parent>  '["<state>",<result JSON>]' once that parent has finished
--   pending     parents not finished yet (children only)
--   failing     on="success" parents that ended other than done (what keeps it cancelled):
--               a reopen reads it, not every parent's end (absent on a child stored before it existed)
-- and in the queue's slot, QBASE..'waiting', a set of the queue's waiting jobs (for stats).
local WAITING_S = QBASE .. 'waiting'

-- Is the parent's k:<child> an edge of the job now stored under that id? A done child's hash
-- expires (done_ttl) without unlink, and an id the caller chose may name a new job later:
-- its parent's end must not settle that job, nor its replay reopen it. A stale edge goes.
local function is_edge(parent, child)
  if redis.call('HEXISTS', JOB .. child, 'd:' .. parent) == 1 then return true end
  redis.call('HDEL', JOB .. parent, 'k:' .. child)
  return false
end

local function unfinished(state)
  return state == 'queued' or state == 'running' or state == 'retrying' or state == 'waiting'
end

-- Whether a recorded end ('p:' field) of a parent over an edge 'on' keeps its child cancelled.
local function fails(ended, on)
  return on == 'success' and ended ~= false and ended ~= nil and string.sub(ended, 1, 7) ~= '["done"'
end

-- A parent's end recorded on (or taken off) a child changes its 'failing' count. A child
-- stored before the count existed has none: its first reopen counts it (reopen, below).
local function count_failing(ckey, was, now)
  if was ~= now and redis.call('HEXISTS', ckey, 'failing') == 1 then
    redis.call('HINCRBY', ckey, 'failing', now and 1 or -1)
  end
end

-- A job reached a finished state: record it on each waiting child, cancel
-- the on="success" children of a failed parent (and theirs, a worklist, not
-- recursion), release the children with nothing left pending. Called in the
-- same script as the write that ends the job: the release is exactly once.
settle = function(id, state, result)
  local work = {{id, state, result}}
  local released = false
  local n = 1
  while n <= #work do
    local pid, pstate, presult = work[n][1], work[n][2], work[n][3]
    n = n + 1
    -- An operator may cancel (or discard) a waiting job; an ack or a dead-letter never ends one.
    if pstate == 'cancelled' then redis.call('SREM', WAITING_S, pid) end
    if redis.call('HGET', JOB .. pid, 'kids') then
      local fields = redis.call('HGETALL', JOB .. pid)
      for i = 1, #fields, 2 do
        if string.sub(fields[i], 1, 2) == 'k:' and is_edge(pid, string.sub(fields[i], 3)) then
          local child, on = string.sub(fields[i], 3), fields[i + 1]
          local ckey = JOB .. child
          local cstate = redis.call('HGET', ckey, 'state')
          -- Recorded on every child still stored: a reopened child needs to know which parents failed.
          if cstate then
            local ended = '["' .. pstate .. '",' .. (presult or 'null') .. ']'
            if on == 'success' then count_failing(ckey, fails(redis.call('HGET', ckey, 'p:' .. pid), on), fails(ended, on)) end
            redis.call('HSET', ckey, 'p:' .. pid, ended)
          end
          if cstate == 'waiting' then
            local left = redis.call('HINCRBY', ckey, 'pending', -1)
            if (pstate ~= 'done' and on == 'success') or left == 0 then redis.call('SREM', WAITING_S, child) end
            if pstate ~= 'done' and on == 'success' then
              -- Like an operator's cancel (end_cancelled), without settling here: the worklist does.
              redis.call('HSET', ckey, 'state', 'cancelled', 'reason', 'parent_failed', 'finished_at', NOW_SECS,
                'cancel_request', '{"by":"workflow","reason":"parent_failed","at":' .. NOW_SECS .. '}')
              redis.call('ZADD', CANCELLED_Z, NOW, child)
              redis.call('ZREM', EXPIRING, child)
              free_key(ckey, child)
              tell_waiters(ckey, child)
              work[#work + 1] = {child, 'cancelled', nil}
            elseif left == 0 then
              watch_expiry(ckey, child)  -- an expiry counts from now on: it can expire only once queued
              local f = redis.call('HMGET', ckey, 'priority', 'run_at')
              local run = math.floor(tonumber(f[2]) * 1000000 + 0.5)
              if run > NOW then
                redis.call('ZADD', DELAYED, run, child)
                redis.call('HSET', ckey, 'state', 'queued')
              else
                redis.call('HSET', ckey, 'state', 'queued', 'run_at', NOW_SECS)
                make_ready(child, f[1], NOW)
                released = true
              end
            end
          end
        end
      end
    end
  end
  if released then redis.call('PUBLISH', CHANNEL, '1') end
end

-- The parents of a child not finished yet, and (for a child stored before 'failing' existed)
-- how many failed it: one read of its whole hash, done when it is about to wait again.
local function open_parents(ckey)
  local cf = redis.call('HGETALL', ckey)
  local seen, deps = {}, {}
  for j = 1, #cf, 2 do
    local name = string.sub(cf[j], 1, 2)
    if name == 'd:' then deps[string.sub(cf[j], 3)] = cf[j + 1]
    elseif name == 'p:' then seen[string.sub(cf[j], 3)] = cf[j + 1] end
  end
  local pending, failing = 0, 0
  for parent, on in pairs(deps) do
    if not seen[parent] then pending = pending + 1
    elseif fails(seen[parent], on) then failing = failing + 1 end
  end
  return pending, failing
end

-- The positions of ``ids`` with each child after its parents among them, otherwise in the order
-- given: depth first, each id after the parents named with it (a walk with a stack and a resume
-- index per id, linear in ids and edges; a sorted list of ready ids was quadratic, seconds of
-- BUSY for a parent replayed with 10,000 children). A requeue or replay puts a parent back first.
local function parents_first(ids)
  local pos, parents, order, seen, next_at = {}, {}, {}, {}, {}
  for i, id in ipairs(ids) do pos[id] = i end
  if #ids > 1 then
    for i, id in ipairs(ids) do
      if redis.call('HEXISTS', JOB .. id, 'pending') == 1 then
        for _, name in ipairs(redis.call('HKEYS', JOB .. id)) do
          local p = string.sub(name, 1, 2) == 'd:' and pos[string.sub(name, 3)]
          if p and p ~= i then
            parents[i] = parents[i] or {}
            parents[i][#parents[i] + 1] = p
          end
        end
      end
    end
  end
  for i = 1, #ids do
    if not seen[i] then
      local stack = {i}
      seen[i] = true
      while #stack > 0 do
        local top = stack[#stack]
        local mine, at = parents[top], next_at[top] or 1
        while mine and at <= #mine and seen[mine[at]] do at = at + 1 end
        next_at[top] = at + 1
        if mine and at <= #mine then
          seen[mine[at]] = true
          stack[#stack + 1] = mine[at]
        else
          stack[#stack] = nil
          order[#order + 1] = top
        end
      end
    end
  end
  return order
end

-- A child an operator requeues waits again for the parents not finished now (it was cancelled
-- while they ran, or one of them was replayed since): their ends recorded on it go (a replay of a
-- parent does not touch a child the operator cancelled). Returns how many it waits for. A parent
-- whose hash lacks the edge is gone (deleted, its id perhaps taken by a new job): it ended.
local function wait_again(ckey, child)
  local cf = redis.call('HGETALL', ckey)
  local pending = 0
  for j = 1, #cf, 2 do
    if string.sub(cf[j], 1, 2) == 'd:' then
      local pkey = JOB .. string.sub(cf[j], 3)
      local p = redis.call('HMGET', pkey, 'state', 'k:' .. child)
      if p[2] and unfinished(p[1]) then
        pending = pending + 1
        local ended = redis.call('HGET', ckey, 'p:' .. string.sub(cf[j], 3))
        if ended then
          redis.call('HDEL', ckey, 'p:' .. string.sub(cf[j], 3))
          count_failing(ckey, fails(ended, cf[j + 1]), false)
        end
      end
    end
  end
  return pending
end

-- Has the child an on="success" parent that ended dead, cancelled or expired and is still stored
-- (its hash holds the edge)? A requeue refuses it (parent_failed), as the SQL brokers do: run now,
-- it would run without that parent ever succeeding; a replay or requeue of the parent reopens it.
local function failed_parent(ckey, child)
  local cf = redis.call('HGETALL', ckey)
  for j = 1, #cf, 2 do
    if string.sub(cf[j], 1, 2) == 'd:' and cf[j + 1] == 'success' then
      local p = redis.call('HMGET', JOB .. string.sub(cf[j], 3), 'state', 'k:' .. child)
      if p[2] and (p[1] == 'dead' or p[1] == 'cancelled' or p[1] == 'expired') then return true end
    end
  end
  return false
end

-- A finished job goes back (dlq replay): its waiting children wait on it
-- again; the children it cancelled wait again unless another on="success"
-- parent still failed them, and so on down the tree. A child's 'failing'
-- count says so without reading its other parents' ends: replaying the N
-- dead members of a fan-in reads the callback's N parents once, not N times.
-- The keys of the jobs a requeue puts back (requeue.lua), which no child the call's parents
-- bring back takes: it stays cancelled, listed in 'children', whatever the order of the ids.
-- A job of the call itself ('call') is never held.
local requeue_holds = {keys = {}, call = {}, children = {}}
reopen = function(id)
  local work = {id}
  local n = 1
  while n <= #work do
    local pid = work[n]
    n = n + 1
    if redis.call('HGET', JOB .. pid, 'kids') then
      local fields = redis.call('HGETALL', JOB .. pid)
      local children, edge = {}, {}
      for i = 1, #fields, 2 do
        if string.sub(fields[i], 1, 2) == 'k:' and is_edge(pid, string.sub(fields[i], 3)) then
          local child = string.sub(fields[i], 3)
          children[#children + 1] = child
          edge[child] = fields[i + 1]
        end
      end
      -- In id order, as the SQL brokers: of two cancelled siblings with one key, the first reopens.
      table.sort(children)
      for _, child in ipairs(children) do
        local ckey = JOB .. child
        local f = redis.call('HMGET', ckey, 'state', 'reason', 'p:' .. pid, 'failing')
        if f[1] == 'waiting' then
          if redis.call('HDEL', ckey, 'p:' .. pid) == 1 then
            redis.call('HINCRBY', ckey, 'pending', 1)
            count_failing(ckey, fails(f[3], edge[child]), false)
          end
        elseif f[1] == 'cancelled' and f[2] == 'parent_failed' then
          redis.call('HDEL', ckey, 'p:' .. pid)
          local failing = tonumber(f[4])
          if failing == nil then
            failing = select(2, open_parents(ckey))
            redis.call('HSET', ckey, 'failing', failing)
          elseif fails(f[3], edge[child]) then
            failing = redis.call('HINCRBY', ckey, 'failing', -1)
          end
          local blocked, pending = failing > 0, nil
          if not blocked then
            -- The one whole read, when the count says it may reopen: the count drifts while
            -- supervisors of an earlier release (whose scripts change p: fields only) share the broker.
            local still
            pending, still = open_parents(ckey)
            if still > 0 then
              redis.call('HSET', ckey, 'failing', still)
              blocked = true
            end
          end
          -- Cancelled, it gave up its key: a job that took the key since carries that effect,
          -- so the child stays cancelled (naming the holder) rather than make a second holder.
          local ikey = not blocked and redis.call('HGET', ckey, 'idempotency_key')
          if ikey and requeue_holds.keys[ikey] and not requeue_holds.call[child] then
            blocked, ikey = true, false
            requeue_holds.children[#requeue_holds.children + 1] = child
          end
          local holder = ikey and redis.call('HGET', IDEM, ikey)
          if holder and holder ~= child and unfinished(redis.call('HGET', JOB .. holder, 'state')) then
            blocked = true
            redis.call('HSET', ckey, 'cancel_request', '{"by":"workflow","reason":"parent_failed","at":'
              .. (redis.call('HGET', ckey, 'finished_at') or 'null') .. ',"key_held_by":' .. cjson.encode(holder) .. '}')
          end
          if not blocked then
            redis.call('HSET', ckey, 'state', 'waiting', 'pending', pending)
            redis.call('HDEL', ckey, 'reason', 'finished_at', 'cancel_request')
            redis.call('ZREM', CANCELLED_Z, child)
            redis.call('SADD', WAITING_S, child)
            if ikey then redis.call('HSET', IDEM, ikey, child) end  -- waiting again: it holds its key again
            work[#work + 1] = child
          end
        end
      end
    end
  end
end

-- Prune keeps a child cancelled by an on="success" parent that lies dead: replaying that parent
-- reopens it, and so on down the tree (README "Workflows"). So is one whose parent is itself
-- cancelled parent_failed: the subtree under a dead job stays, each child decided by one look at
-- its parents (no walk up the tree). Read through the child's own d: fields.
local function replayable(key, id)
  if redis.call('HGET', key, 'reason') ~= 'parent_failed' then return false end
  local fields = redis.call('HGETALL', key)
  for i = 1, #fields, 2 do
    if string.sub(fields[i], 1, 2) == 'd:' and fields[i + 1] == 'success' then
      local pkey = JOB .. string.sub(fields[i], 3)
      local p = redis.call('HMGET', pkey, 'state', 'reason')
      if (p[1] == 'dead' or (p[1] == 'cancelled' and p[2] == 'parent_failed'))
          and redis.call('HEXISTS', pkey, 'k:' .. id) == 1 then
        return true
      end
    end
  end
  return false
end

-- A job about to be deleted (discard, purge, prune) takes its edges off its parents: an id
-- the caller chose may name a new job later, which those parents' end must not settle, nor
-- their replay reopen. 'pending' marks a child (set at enqueue, never removed). One page of
-- them (HSCAN: all of a small hash): a group's callback has up to 100,000 parents, and taking
-- them all off held Redis about a second, no claim or lease renewal answered. An edge left
-- behind is dropped when followed (is_edge), as a done child's expired hash leaves its edges.
local UNLINK_PAGE = 1000
local function unlink(key, id)
  if redis.call('HEXISTS', key, 'pending') == 0 then return end
  local fields = redis.call('HSCAN', key, 0, 'MATCH', 'd:*', 'COUNT', UNLINK_PAGE)[2]
  for i = 1, #fields, 2 do
    redis.call('HDEL', JOB .. string.sub(fields[i], 3), 'k:' .. id)
  end
end
