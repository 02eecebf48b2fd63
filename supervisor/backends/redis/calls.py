"""Running the broker's scripts: one call, or several in one round trip, and WAIT after writes.

With ``wait_replicas=N`` in the URL (``broker.redis_wait_replicas`` in the
config), a write the caller must be able to rely on (an enqueue, an outcome)
is followed by ``WAIT N timeout`` in the same pipeline: WAIT covers the writes
made earlier on its own connection, and a pipeline is one connection. When
fewer than N replicas confirm in time the call raises ``BrokerError``: the
write happened on the primary but a failover may still lose it, so the caller
must not count on it (a producer retries with an idempotency key; the
daemon's outcome write is retried and meets ``LeaseLost`` if it had landed).

On a cluster, redis-py does not pipeline scripts (its cluster pipeline
refuses EVALSHA), so the calls run one after the other, each sent to the node
serving its queue's slot; a call redis-py sent again after losing an answer
counts in ``calls_resent`` as on one server (``connection.CountingCluster``).

An enqueue adds its queue's name to ``P:queues`` (a queue is known before it
holds a job): inside the enqueue script, given the set as an extra key, so
an enqueue sends one command; on a cluster the set lies outside the queue's
slot, and a ``SADD`` round trip of its own goes first and another after, so
that a prune which took the name out of the set meanwhile (the queue was empty:
prune.py) cannot leave the new jobs without it.

On one server (no Sentinel, no ``max_connections``), one connection stays
checked out of redis-py's pool between calls, for whichever thread finds it
free (the master's loop, most producers); a thread that finds it in use takes
one from the pool. The pool's checkout and return cost 15 µs of CPU a call
(its bookkeeping and metrics hooks, a non-blocking read between two timeout
changes), a sixth of a single enqueue's (bench/README.md, "A twenty-second
machine"). The kept one is checked as the pool
checks what it hands out (open, nothing unread, not closed by the server: see
``_ready``), so a connection the server dropped while idle is reopened before
the sending, not found dead after it. On TLS that check is the pool's own read
(bytes on the socket may be the TLS layer's, a session ticket): about half the
saving. A Sentinel pool keeps the return: it is where the connections to a
demoted primary are dropped.
"""
import os
import select
import ssl

import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ...errors import BrokerError
from . import keys as keys_module
from . import scripts

# A script argument longer than this goes through redis-py's packer (its buffer cutoff).
LARGE = 6000

# redis-py 8.2 and later check a connection the pool hands out in a method of its own.
POOL_CHECKS = hasattr(redis.ConnectionPool, "ensure_connection")


class ScriptCalls:
    """Mixin of ``RedisBroker``: needs ``r``, ``keys``, ``scripts``, ``cluster``, ``replica_wait`` and ``where``."""

    answers_lost = 0  # sendings on one server whose answer was lost (a cluster's client counts its own)
    _heads = None  # (script's sha, queue, more keys) -> its calls' packed arguments before the script's own (_packed)
    _encode = None  # the pool's encoder's encode: what redis-py's packer applies to each argument
    _kept = None  # (pid, connection) kept checked out of the pool (module docstring); a forked child opens its own

    def _lost(self):
        """Sendings so far whose answer was lost: each may have run on the server."""
        return self.r.answers_lost if self.cluster else self.answers_lost

    def _run(self, name, queue, args, confirm=False):
        if not self.cluster:
            # Through _exchange, not redis-py's Script object: the same packing and
            # reading without its per-call wrappers (a claim is the master's hottest call).
            return self._run_many([(name, queue, args)], confirm=confirm)[0]
        keys, head = self.keys.for_scripts(queue)
        lost = self.r.answers_lost
        result = self.scripts[name](keys=keys, args=head + list(args), client=self.r)
        if self.r.answers_lost != lost:  # redis-py resent it: the first sending may have run (connection.CountingCluster)
            self.calls_resent += 1
        return result

    def _run_enqueues(self, calls):
        """Enqueue scripts' calls (``enqueue``, ``enqueue_once``, ``enqueue_flow``), confirmed:
        each also adds its queue to ``P:queues`` (see the module docstring)."""
        if self.cluster:
            names = dict.fromkeys(queue for _, queue, _ in calls)
            self.r.sadd(self.keys.queues, *names)
            try:
                return self._run_many(calls, confirm=True)
            finally:  # a call that failed may follow one that stored its jobs
                self.r.sadd(self.keys.queues, *names)
        return self._run_many(calls, confirm=True, more_keys=(self.keys.queues,))

    def _run_many(self, calls, confirm=False, more_keys=()):
        """Several script calls in one round trip; WAIT last if ``confirm``. ``more_keys``
        follow each call's queue keys (KEYS[7]...)."""
        if self.cluster:
            return [self._run(name, queue, args) for name, queue, args in calls]
        wait = self.replica_wait if confirm else None
        for attempt in (1, 2):
            commands = [self._packed(name, queue, more_keys, args) for name, queue, args in calls]
            if wait:
                commands.append(("WAIT", *wait))
            results = self._exchange(commands)
            confirmed = results.pop() if wait else None
            if attempt == 1 and any(isinstance(r, NoScriptError) for r in results):
                # The server lost its script cache (a restart, a failover): every script here is safe to resend.
                scripts.load(self.r, self.scripts)
                continue
            for r in results:
                if isinstance(r, Exception):
                    raise r
            if isinstance(confirmed, Exception):
                raise confirmed
            if wait and confirmed < wait[0]:
                raise BrokerError(f"redis broker {self.where}: the write reached {confirmed} of {wait[0]} replica(s)"
                                  f" within {wait[1]} ms (wait_replicas); a failover now could lose it")
            return results

    def _packed(self, name, queue, more_keys, args):
        """One EVALSHA call as the bytes redis-py's packer makes of it. Every argument before
        ``args`` (the sha, the keys, the job key prefix, the channel) is the same for a script
        and queue on every call: packed once. Packing all 13 arguments of an enqueue each
        time was 10 µs of its CPU, as much as checking the job."""
        if self._heads is None:
            self._heads, self._encode = {}, self.r.connection_pool.get_encoder().encode  # the pool's encoding
        heads, encode = self._heads, self._encode
        sha = self.scripts[name].sha  # by the sha, not the name: a reload may give the script another
        head = heads.get((sha, queue, more_keys))
        if head is None:
            keys, argv = self.keys.for_scripts(queue)  # checks the queue's name
            parts = ("EVALSHA", sha, len(keys) + len(more_keys), *keys, *more_keys, *argv)
            if len(heads) >= keys_module.KEPT_QUEUES:
                heads.clear()
            head = heads[sha, queue, more_keys] = (
                len(parts), b"".join(b"$%d\r\n%s\r\n" % (len(v), v) for v in map(encode, parts)))
        count, text = head
        tail = list(map(encode, args))
        if any(len(v) > LARGE for v in tail):  # redis-py's packer sends a large value without copying it
            keys, argv = self.keys.for_scripts(queue)
            return ("EVALSHA", sha, len(keys) + len(more_keys), *keys, *more_keys, *argv, *args)
        return b"".join((b"*%d\r\n" % (count + len(tail)), text,
                         *[b"$%d\r\n%s\r\n" % (len(v), v) for v in tail]))

    def _exchange(self, commands):
        """Send commands in one write on one pooled connection and read every reply (an error reply
        comes back in its place): what redis-py's pipeline does, with redis-py's own packing and
        reading, without the pipeline object's per-call bookkeeping (more CPU than the rest of an
        enqueue). Retried as redis-py retried the pipeline
        (the client's ``Retry``: once, on a connection error, after reconnecting)."""
        conn, kept = self._checkout()
        sent = []

        def send():
            if sent:  # the server may have run the first sending: its answer was lost, not its effects
                self.calls_resent += 1
                self.answers_lost += 1
            sent.append(True)
            return _send_and_read(conn, commands)

        try:
            return conn.retry.call_with_retry(send, lambda _: conn.disconnect())
        except BaseException:
            conn.disconnect()  # a reply may be left unread: the socket is out of step
            self.answers_lost += 1  # sent on a connection the pool had open: it may have run
            raise
        finally:
            if kept:
                self._kept_lock.release()
            else:
                self.r.connection_pool.release(conn)

    def _checkout(self):
        """(a connection to send on, whether it is the kept one): see the module docstring."""
        pool = self.r.connection_pool
        if self._kept_lock is None or not self._kept_lock.acquire(blocking=False):
            return pool.get_connection(), False
        try:
            if self._kept is None or self._kept[0] != os.getpid():
                self._kept = (os.getpid(), pool.get_connection())
            else:
                _ready(self._kept[1], pool)
        except BaseException:
            self._kept_lock.release()
            raise
        return self._kept[1], True


def _send_and_read(conn, commands):
    """Commands are argument tuples, or bytes packed already (``ScriptCalls._packed``)."""
    if any(type(command) is bytes for command in commands):
        packed = [command if type(command) is bytes else b"".join(conn.pack_command(*command))
                  for command in commands]
        conn.send_packed_command([b"".join(packed)])
    else:
        conn.send_packed_command(conn.pack_commands(commands))
    replies = []
    for _ in commands:
        try:
            replies.append(conn.read_response())
        except ResponseError as exc:
            replies.append(exc)
    return replies


def _ready(conn, pool):
    """The pool's check of a connection it hands out (``ensure_connection``: open, nothing
    unread, not closed by the server) in one poll, where the pool reads the socket between two
    timeout changes: about 5 µs less of a call's CPU. On TLS, the pool's own check."""
    conn.connect()  # reopens one closed after an error; raises before anything is sent
    # Marked by redis-py (a maintenance notice: the endpoint moves), which the pool acts on at
    # the return this connection never makes; redis-py before 7 has no such mark.
    marked = getattr(conn, "should_reconnect", None)
    if marked is not None and marked():
        conn.disconnect()
        conn.connect()
        return
    sock = getattr(conn, "_sock", None)
    if sock is None or isinstance(sock, ssl.SSLSocket):
        # TLS: a readable socket may hold only the TLS layer's own records (a session ticket),
        # and a reply may wait decrypted in its buffer with nothing on the socket. Only a read
        # through it tells: the pool's (and a redis-py that names its socket otherwise).
        if POOL_CHECKS:
            pool.ensure_connection(conn)
            return
        try:  # redis-py before 8.2: its pool did this inside get_connection
            if conn.can_read():
                raise RedisConnectionError("data waiting")
        except (RedisConnectionError, OSError, RedisTimeoutError):
            conn.disconnect()
            conn.connect()
        return
    poller = select.poll()  # not select.select: a busy process's descriptors pass 1024
    poller.register(sock, select.POLLIN)
    if poller.poll(0):  # readable: closed by the server, or a stray reply
        conn.disconnect()
        conn.connect()
