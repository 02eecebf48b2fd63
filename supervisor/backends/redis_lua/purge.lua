-- purge: ARGV[3..] = ids, all dead, or nothing is deleted.
-- Returns {'ok', count} or {'notdead', id, state}.
for k = 3, #ARGV do
  local state = redis.call('HGET', JOB .. ARGV[k], 'state')
  if state ~= 'dead' then return {'notdead', ARGV[k], state or 'unknown'} end
end
for k = 3, #ARGV do
  unindex_job(ARGV[k], redis.call('HMGET', JOB .. ARGV[k], 'queued_at', 'type'))
  unlink(JOB .. ARGV[k], ARGV[k])
  redis.call('UNLINK', JOB .. ARGV[k])  -- freed in the background: a group's callback is big
  redis.call('ZREM', DEAD, ARGV[k])
end
return {'ok', #ARGV - 2}
