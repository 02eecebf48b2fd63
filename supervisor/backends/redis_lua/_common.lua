-- Prelude shared by every Tangguh script (prepended when the module loads them).
--
-- KEYS are one queue's keys, all carrying the queue's hash tag ({queue}), so a
-- script touches a single Redis Cluster slot. Job hashes live in the same slot
-- ("<prefix>:{<queue>}:j:<id>"); their names are built from ARGV[1].
-- Times are integer microseconds of the server clock (TIME); hashes store them
-- as seconds with six decimals, zsets score them in microseconds.
local READY, DELAYED, LEASED, DEAD, DONE, IDEM = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local JOB, CHANNEL = ARGV[1], ARGV[2]
local clock = redis.call('TIME')
local NOW = tonumber(clock[1]) * 1000000 + tonumber(clock[2])

-- Lua's tostring keeps 14 digits: format microsecond values explicitly.
local function num(us)
  return string.format('%.0f', us)
end

local function secs(us)
  return string.format('%d.%06d', math.floor(us / 1000000), us % 1000000)
end

-- This call's instant as text, formatted once: a claim or an ack of 32 jobs wrote it 32 to 64 times.
local NOW_SECS = secs(NOW)

-- A count the scripts keep (an attempt, a lease token): an integer, so '%d' (exact to 2^63),
-- at 2.5 times the speed of num's '%.0f', which also rounds the fractions num is given.
local function count_text(n)
  return string.format('%d', n)
end

-- model.first_token: a job whose id the caller chose (a token other than 0 in its fields)
-- starts from the later of the producer's clock and this server's, in units of 2^-20 s: a
-- producer whose clock lags (another host, a clock stepped back) cannot give the new job the
-- tokens of a deleted one's leases.
local function chosen_id_token(fields)
  for k = 1, #fields - 1, 2 do
    if fields[k] == 'token' then
      if fields[k + 1] ~= '0' then
        fields[k + 1] = num(math.max(tonumber(fields[k + 1]), math.floor(NOW * 1.048576)))
      end
      return
    end
  end
end

-- A new lease's fencing token: one above the last, and no lower than this server's clock in
-- units of 2^-20 s. Replication is asynchronous: a claim the old primary made may be missing
-- on the promoted replica, whose next claim of the job would then hand out the lost claim's
-- token again, and the first owner's renewals and outcome would pass as the second's.
local function next_token(last)
  return count_text(math.max((tonumber(last) or 0) + 1, math.floor(NOW * 1.048576)))
end

-- Ready jobs: score -priority; members "<16-digit run_at us><id>", so ZPOPMIN
-- yields highest priority first, then oldest run_at, then id.
local function make_ready(id, priority, run_us)
  -- A priority a hand-edited hash holds as other text: 0 here (an error would strand the job between
  -- the delayed and ready sets), then the claim dead-letters the job (backends/damaged.py).
  redis.call('ZADD', READY, -(tonumber(priority) or 0), string.format('%016.0f', run_us) .. id)
end

-- A leased job as claim returns it (fields.from_claim reads it): its fields in this order
-- (the Job's own up to pending, then the open attempt; a missing one is false) as one JSON
-- array led by 0. Half the text of the hash's pairs, decoded without a dict. The open
-- attempt, the JSON object the claim has just written, goes in as an object, not as a
-- string: the client decodes it with the reply instead of once more per job. A workflow
-- child (pending set) comes as its whole hash instead: its parents' fields vary.
local ROW_FIELDS = {'id', 'type', 'queue', 'payload', 'state', 'resource_id', 'idempotency_key', 'attempt',
  'max_attempts', 'timeout', 'priority', 'run_at', 'queued_at', 'trace_id', 'token', 'lease_until', 'owner',
  'result', 'error', 'reason', 'first_failure_at', 'last_failure_at', 'finished_at', 'history', 'expires_at',
  'progress', 'progress_note', 'cancel_request', 'pending', 'open'}
local OPEN_AT = #ROW_FIELDS
local PENDING_AT = OPEN_AT - 1
-- Where lease_row writes the lease into a row read before it (ROW_FIELDS' order).
local STATE_AT, ATTEMPT_AT, TOKEN_AT, UNTIL_AT, OWNER_AT, EXPIRES_AT = 5, 8, 15, 16, 17, 25

local function row_text(key, v)
  if v[PENDING_AT] then return cjson.encode(redis.call('HGETALL', key)) end
  local open = v[OPEN_AT] or 'false'
  v[OPEN_AT] = nil
  return '[0,' .. string.sub(cjson.encode(v), 2, -2) .. ',' .. open .. ']'
end

local function claimed_row(key)
  return row_text(key, redis.call('HMGET', key, unpack(ROW_FIELDS)))
end

-- Lease a ready job whose ROW_FIELDS ``v`` were just read; returns its claimed_row, written
-- from ``v`` with the lease put in, not read back: one HMGET a job, not two. Every value it
-- writes goes into the hash and the row as the same string; ``lease_until`` is the lease's end as text.
local function lease_row(key, v, lease_until, owner, owner_json)
  local attempt, token = count_text((tonumber(v[ATTEMPT_AT]) or 0) + 1), next_token(v[TOKEN_AT])
  local open = '{"attempt":' .. attempt .. ',"started_at":' .. NOW_SECS .. ',"owner":' .. owner_json .. '}'
  redis.call('HSET', key, 'state', 'running', 'attempt', attempt, 'token', token, 'lease_until', lease_until,
    'owner', owner, 'open', open)
  v[STATE_AT], v[ATTEMPT_AT], v[TOKEN_AT], v[UNTIL_AT], v[OWNER_AT], v[OPEN_AT] =
    'running', attempt, token, lease_until, owner, open
  return row_text(key, v)
end

-- A claim's reply: its rows (JSON texts) as one JSON array, one bulk reply for the client
-- to read instead of one per job.
local function json_array(rows)
  return '[' .. table.concat(rows, ',') .. ']'
end

local function is_leased(key, token)
  local v = redis.call('HMGET', key, 'state', 'token')
  return v[1] == 'running' and v[2] == token
end

-- The open attempt lives in field "open" (a JSON object); closing it appends
-- it to "history" with `suffix` (',"k":v,...') merged in: later keys win when
-- the JSON is read, like SQLite's json_patch.
local function closed_history(history, open, suffix)
  history, open = history or '[]', open or '{}'
  local entry
  if open == '{}' then entry = '{' .. string.sub(suffix, 2) .. '}'
  else entry = string.sub(open, 1, -2) .. suffix .. '}' end
  if history == '[]' then return '[' .. entry .. ']' end
  return string.sub(history, 1, -2) .. ',' .. entry .. ']'
end

local function close_entry(key, suffix)
  local v = redis.call('HMGET', key, 'history', 'open')
  redis.call('HSET', key, 'history', closed_history(v[1], v[2], suffix))
  redis.call('HDEL', key, 'open')
end

-- A finished job gives its idempotency key back (free_key_of: the key already read).
local function free_key_of(ikey, id)
  if ikey and redis.call('HGET', IDEM, ikey) == id then
    redis.call('HDEL', IDEM, ikey)
  end
end

local function free_key(key, id)
  free_key_of(redis.call('HGET', key, 'idempotency_key'), id)
end

local function failed_now(key)
  redis.call('HSETNX', key, 'first_failure_at', NOW_SECS)
  redis.call('HSET', key, 'last_failure_at', NOW_SECS)
end

-- ',"pid":1,...' from the caller's info object body ('' when empty)
local function info_part(body)
  if body == '' then return '' end
  return ',' .. body
end

-- The search index: BASE..'search', every job of the queue at score 0, member
-- "<16-digit queued_at us><id>", so lexicographic ranges are (queued_at, id) ranges.
local SEARCH = string.sub(JOB, 1, -3) .. 'search'

local function search_member(id, queued_us)
  return string.format('%016.0f', queued_us) .. id
end

-- Workflows: defined in _flows.lua (see there), declared here so that every
-- helper that ends a job (in _control.lua too) can settle its children.
local settle, reopen
