-- A queue's state as a whole (prune.lua, queue_empty.lua).

-- Whether the queue holds nothing: no job in any state (the search index has every job), no
-- enqueue_once record, no sweep of a type index or of an exclusive type's resources to
-- finish, no pause. Prune takes such a queue's name out of P:queues.
local function queue_empty()
  return redis.call('EXISTS', READY, DELAYED, LEASED, DEAD, DONE, IDEM, SEARCH, TYPES, QBASE .. 'once',
    CANCELLED_Z, EXPIRED_Z, EXPIRING, PAUSED, WAITING_S, QBASE .. 'excls') == 0
end
