-- mark_waited: ARGV[3] = id. Asks for a message on CHANNEL..':done' when the job
-- finishes (see _control.lua); nothing when the job does not exist.
local key = JOB .. ARGV[3]
if redis.call('EXISTS', key) == 1 then redis.call('HSET', key, 'waited', '1') end
return 1
