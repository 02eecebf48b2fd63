"""The Redis broker's key layout.

``P`` = prefix, ``Q`` = queue name; the braces are a hash tag, so all of a
queue's keys share one Redis Cluster slot::

    P:{Q}:j:<id>   hash    one job: fields of ``Job``; payload, result, error and
                           history are JSON strings, the open attempt is "open"
    P:{Q}:ready    zset    due jobs: score -priority, member "<run_at us:016><id>",
                           so ZPOPMIN gives priority desc, run_at asc, id asc
    P:{Q}:delayed  zset    delayed and backing-off jobs by run_at (us); the claim
                           script promotes the due ones to ready
    P:{Q}:leased   zset    running jobs by lease deadline (us)
    P:{Q}:dead     zset    the dead-letter queue by failure time (us)
    P:{Q}:done     zset    retained done jobs by finish time (us); the job hashes
                           carry an EXPIRE of done_ttl, stale entries are trimmed
    P:{Q}:idem     hash    idempotency key -> id of the unfinished job holding it
    P:{Q}:once     zset    enqueue_once keys by first use (us); prune trims them
                           (and P:{~once}:queue/at: each key's queue, across queues, and
                           P:{~once}:ticks: each schedule's newest tick: once.py)
    P:{Q}:search   zset    every job at score 0, member "<queued_at us:016><id>":
                           search's (queued_at, id) order (see search.py)
    P:{Q}:search:type:T    zset  the same members for the jobs of type T
    P:{Q}:search:types     set   the types with such an index (prune sweeps them)
    P:{Q}:run:T    set     ids of type T leased under a concurrency limit
    P:{Q}:excl:T   hash    resource id -> the job of exclusive type T last leased on it;
                           prune drops the fields of jobs no longer running
    P:{Q}:excls    set     the exclusive types with such a hash (prune sweeps them)
    P:{Q}:rate:T   hash    type T's token bucket: tokens, ts (us)
    P:queues       set     the queues enqueued to or paused (dlq_list, prune, get);
                           prune (and resume) takes out a queue with nothing left
    P:wakeup       channel published when a job becomes due now

Scripts reach job hashes (and the ``run``/``excl``/``rate`` keys) by names
built from a prefix argument rather than declared in KEYS; they are in the
declared keys' slot, which Redis Cluster serves (it checks slots, not names),
though a cluster proxy that routes strictly by KEYS would not. ``P:queues``
lives outside the queue slots. Queue names may not contain braces (they would
break the hash tag).
"""
from ...model import check_queue

# A queue's keys every script is given, in this order (the scripts' KEYS[1..6]).
SCRIPT_KEYS = ("ready", "delayed", "leased", "dead", "done", "idem")
# Queues whose key names are kept made: a producer may name any number of queues, and prune
# and the lookups walk every name ever used (P:queues); past this the cache starts again.
KEPT_QUEUES = 1024


class Keys:
    def __init__(self, prefix):
        self.prefix = prefix
        self.queues = f"{prefix}:queues"
        self.channel = f"{prefix}:wakeup"
        self._scripts = {}  # queue -> (keys, argv head)

    def for_scripts(self, queue):
        """(KEYS, the first ARGV: job key prefix, wake-up channel) of a queue's scripts.

        Checks the queue's name first: a bad one raises BadInput before anything is stored.
        """
        got = self._scripts.get(queue)
        if got is None:
            check_queue(queue)  # no braces above all: they would move the keys out of the hash tag
            if len(self._scripts) >= KEPT_QUEUES:
                self._scripts.clear()
            base = f"{self.prefix}:{{{queue}}}:"
            got = self._scripts[queue] = ([base + k for k in SCRIPT_KEYS], [base + "j:", self.channel])
        return got

    def dead(self, queue):
        return self.for_scripts(queue)[0][SCRIPT_KEYS.index("dead")]

    def job(self, queue, job_id):
        return f"{self.prefix}:{{{queue}}}:j:{job_id}"

    def once(self, queue):
        return f"{self.prefix}:{{{queue}}}:once"
