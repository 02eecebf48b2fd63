-- Prelude: the search indexes' upkeep (after _control.lua, whose us_of it uses).
--
-- The type indexes: BASE..'search:type:'..T, the same members for the queue's jobs of
-- type T (a search by type reads it instead of scanning). BASE..'search:types' names the
-- types that have one, so prune can sweep entries whose hash expired (their type is gone
-- with the hash).
local TYPES = SEARCH .. ':types'

local function type_index(t)
  return SEARCH .. ':type:' .. t
end

-- A job's entries in both indexes; `typed` (a table the caller keeps for one call)
-- spares the SADD for a type already named in this call.
local function index_job(id, t, queued_us, typed)
  local m = search_member(id, queued_us)
  redis.call('ZADD', SEARCH, 0, m)
  redis.call('ZADD', type_index(t), 0, m)
  if not typed[t] then
    redis.call('SADD', TYPES, t)
    typed[t] = true
  end
end

-- Drops a job's entries from both indexes; `f` = its hash's {queued_at, type}.
local function unindex_job(id, f)
  local queued = us_of(f[1])
  if not queued then return end
  local m = search_member(id, queued)
  redis.call('ZREM', SEARCH, m)
  if f[2] then redis.call('ZREM', type_index(f[2]), m) end
end

-- A job's type from the [field, value, ...] list enqueue is given.
local function field_of(fields, name)
  for k = 1, #fields - 1, 2 do
    if fields[k] == name then return fields[k + 1] end
  end
  return nil
end
