"""The cache's Redis scripts (``supervisor.toolkit.cache`` runs them): each step that must see
and change several keys at once. Key names are built from the prefix inside them (``ARGV``), so
every key of one cache lives on one Redis instance.
"""

# A lease taken also trims its tags: of 5 members drawn at random, those with neither an entry nor
# a lease go (nothing of theirs is readable, and a new lease adds them again). As fills come, dead
# members fall to about a fifth of a tag, instead of piling up until an invalidation.
# A lease already holding our token is our own earlier run, whose answer was lost: taken (that run
# registered the tags; no store could come since, the store needs this token).
TAKE_LEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('PEXPIRE', KEYS[1], ARGV[2]) return 1 end
if ARGV[5] == 'absent' and redis.call('EXISTS', KEYS[2]) == 1 then return -1 end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  local p = ARGV[6]
  for i = 3, #KEYS do
    for _, key in ipairs(redis.call('SRANDMEMBER', KEYS[i], 5)) do
      if redis.call('EXISTS', p .. 'cache:' .. key, p .. 'cache-lease:' .. key) == 0 then
        redis.call('SREM', KEYS[i], key)
      end
    end
    redis.call('SADD', KEYS[i], ARGV[3])
    if redis.call('PTTL', KEYS[i]) < tonumber(ARGV[4]) then redis.call('PEXPIRE', KEYS[i], ARGV[4]) end
  end
  return 1
end
return 0
"""
# The tags (KEYS[3..]) are made to outlive the entry, or invalidating one would miss it. A tag
# without the key means it expired during the build (leased longer than its TTL, the master
# extending the lease): an invalidation meanwhile could not have cancelled it, so nothing is stored.
STORE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
for i = 3, #KEYS do
  if redis.call('SISMEMBER', KEYS[i], ARGV[4]) == 0 then
    redis.call('DEL', KEYS[1])
    return 0
  end
end
for i = 3, #KEYS do
  if redis.call('PTTL', KEYS[i]) < tonumber(ARGV[5]) then redis.call('PEXPIRE', KEYS[i], ARGV[5]) end
end
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
redis.call('DEL', KEYS[1])
return 1
"""
# Keys and small tags at once; a tag of more than ARGV[2] members is left to DROP_MEMBERS in
# batches (its index among the names is returned), so no script runs long on a shared Redis.
INVALIDATE = """
local p, batch = ARGV[1], tonumber(ARGV[2])
local big = {}
for i = 3, #ARGV do
  local name = ARGV[i]
  redis.call('DEL', p .. 'cache:' .. name, p .. 'cache-lease:' .. name)
  local tag = p .. 'cache-tag:' .. name
  if redis.call('SCARD', tag) <= batch then
    for _, key in ipairs(redis.call('SMEMBERS', tag)) do
      redis.call('DEL', p .. 'cache:' .. key, p .. 'cache-lease:' .. key)
    end
    redis.call('DEL', tag)
  else
    big[#big + 1] = i - 3
  end
end
return big
"""
# One batch of a big tag: each member's entry and lease go with its membership, in one step.
DROP_MEMBERS = """
local p = ARGV[1]
local tag = p .. 'cache-tag:' .. ARGV[2]
for i = 3, #ARGV do
  redis.call('DEL', p .. 'cache:' .. ARGV[i], p .. 'cache-lease:' .. ARGV[i])
  redis.call('SREM', tag, ARGV[i])
end
return #ARGV - 2
"""
# An entry and the milliseconds left of its life, at one instant, writing nothing: a MULTI is
# refused whole by a Redis out of memory, which still answers reads.
READ = """
return {redis.call('GET', KEYS[1]), redis.call('PTTL', KEYS[1])}
"""
