-- resume: the queue's pause goes. A queue with nothing else left (_queue.lua) leaves P:queues
-- (KEYS[7], one server) in the same script, as at prune: queues() lists the queues with jobs,
-- paused or served, as on the SQL brokers, not a resumed empty one until the next prune. On a
-- cluster the set lies in another slot: the caller takes the name out when this returns 1.
redis.call('DEL', PAUSED)
local empty = queue_empty()
if empty and KEYS[7] then redis.call('SREM', KEYS[7], string.match(JOB, '{([^{}]*)}:j:$')) end
return empty and 1 or 0
