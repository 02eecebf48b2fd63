-- queue_empty: 1 if the queue holds nothing (_queue.lua), else 0. On a cluster, prune asks it
-- again after taking the queue's name out of P:queues, which lies in another slot (prune.py).
return queue_empty() and 1 or 0
