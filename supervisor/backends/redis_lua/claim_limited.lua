-- claim_limited: ARGV[3] = n, [4] = lease (us), [5] = owner, [6] = owner as JSON,
-- [7] = the limits as JSON {type: [max_concurrency or -1, exclusive 0/1, rate count or 0,
-- rate period (us)]}, [8] = how many ready entries one call may look at.
-- The claim under per-type limits, sent right after claim.lua with n = 0 (which
-- reclaims expired leases and promotes due delayed jobs). Walks the ready zset in
-- claim order and leases what the limits admit; a held-back job stays where it
-- is, untouched. Per limited type T, in this queue's slot:
--   BASE..'run:'..T   set   ids leased under a concurrency limit; members no
--                           longer running are dropped when counted
--   BASE..'excl:'..T  hash  resource id -> id of the job last leased on it; the
--                           resource is busy while that job is running (prune
--                           drops the fields of jobs no longer running)
--   BASE..'excls'     set   the types with such a hash (prune walks it)
--   BASE..'rate:'..T  hash  the token bucket: tokens, ts (us)
local n, lease, owner, owner_json = tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5], ARGV[6]
local limits, scan_max = cjson.decode(ARGV[7]), tonumber(ARGV[8])
local BASE = string.sub(JOB, 1, -3)
local PAGE = 100
if redis.call('EXISTS', PAUSED) == 1 then return '[]' end
local until_us = NOW + lease
local until_text = secs(until_us)  -- every job of the call is leased until the same instant (as claim.lua)

local state = {}
local function limit_state(t)
  local s = state[t]
  if s then return s end
  local l = limits[t]
  s = {}
  if l then
    if l[1] >= 0 then
      local key = BASE .. 'run:' .. t
      local live = 0
      for _, id in ipairs(redis.call('SMEMBERS', key)) do
        if redis.call('HGET', JOB .. id, 'state') == 'running' then live = live + 1
        else redis.call('SREM', key, id) end
      end
      s.room = l[1] - live
    end
    if l[3] > 0 then
      local b = redis.call('HMGET', BASE .. 'rate:' .. t, 'tokens', 'ts')
      local tokens = tonumber(b[1])
      if tokens then s.tokens = math.min(l[3], tokens + math.max(0, NOW - tonumber(b[2])) * l[3] / l[4])
      else s.tokens = l[3] end
    end
    s.exclusive = l[2] == 1
  end
  state[t] = s
  return s
end

local function lease_job(id, key)
  local attempt = redis.call('HINCRBY', key, 'attempt', 1)
  redis.call('HSET', key, 'token', next_token(redis.call('HGET', key, 'token')), 'state', 'running',
    'lease_until', until_text, 'owner', owner,
    'open', '{"attempt":' .. attempt .. ',"started_at":' .. NOW_SECS .. ',"owner":' .. owner_json .. '}')
  redis.call('ZADD', LEASED, until_us, id)
  redis.call('ZREM', EXPIRING, id)  -- a started job cannot expire (see claim.lua)
  return claimed_row(key)
end

local out, drop = {}, {}
local start, scanned, leased = 0, 0, 0  -- out holds the jobs ended expired too: leased counts
while leased < n and scanned < scan_max do
  local page = redis.call('ZRANGE', READY, start, start + PAGE - 1)
  if #page == 0 then break end
  start = start + #page
  for _, member in ipairs(page) do
    scanned = scanned + 1
    local id = string.sub(member, 17)
    local key = JOB .. id
    local f = redis.call('HMGET', key, 'type', 'resource_id', 'expires_at', 'state')
    if not f[1] then
      drop[#drop + 1] = member  -- the job is gone
    elseif past_expiry(f[3]) and (f[4] == 'queued' or f[4] == 'retrying') then
      -- One of a backlog claim.lua's expire_due left (it ends 1000 per call): ended, never
      -- leased, before the limits count it. Out of the ready zset with the drops, after the
      -- walk, whose ranks a removal now would shift.
      drop[#drop + 1] = member
      end_expired(key, id, f[3], out)
    else
      local s = limit_state(f[1])
      local ok = not (s.room and s.room <= 0) and not (s.tokens and s.tokens < 1)
      local excl
      if ok and s.exclusive and f[2] then
        excl = BASE .. 'excl:' .. f[1]
        local holder = redis.call('HGET', excl, f[2])
        if holder and holder ~= id and redis.call('HGET', JOB .. holder, 'state') == 'running' then ok = false end
      end
      if ok then
        drop[#drop + 1] = member
        if s.room then
          s.room = s.room - 1
          redis.call('SADD', BASE .. 'run:' .. f[1], id)
        end
        if s.tokens then s.tokens = s.tokens - 1 end
        if excl then
          redis.call('HSET', excl, f[2], id)
          redis.call('SADD', BASE .. 'excls', f[1])
        end
        out[#out + 1] = lease_job(id, key)
        leased = leased + 1
      end
    end
    if leased >= n or scanned >= scan_max then break end
  end
end
if #drop > 0 then redis.call('ZREM', READY, unpack(drop)) end
for t, s in pairs(state) do
  if s.tokens then redis.call('HSET', BASE .. 'rate:' .. t, 'tokens', tostring(s.tokens), 'ts', num(NOW)) end
end
return json_array(out)
