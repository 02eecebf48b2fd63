"""Replicated servers the failover tests start on free loopback ports, and kill for real.

* ``SentinelSetup``: a Redis primary, one replica and three Sentinels watching
  them (quorum 2, the primary is "down" after 1 s without an answer).
* ``RedisClusterSetup``: six ``cluster-enabled`` Redis servers joined by
  ``redis-cli --cluster create`` into three primaries with one replica each.
* ``PostgresPair``: a private PostgreSQL primary and a streaming replica made
  from it with ``pg_basebackup -R``; ``promote()`` runs ``pg_ctl promote``.

Everything waits with a deadline for the state it needs, never a bare sleep.
"""
import os
import shutil
import signal
import subprocess

import pytest

from .servers import PostgresCluster, RedisServer, _postgres_bin, free_port
from .util import wait_for

SERVICE = "mymaster"


def missing(what):
    """Skip (or fail under TANGGUH_REQUIRE_SERVICES=1) because ``what`` is not on this machine."""
    if os.environ.get("TANGGUH_REQUIRE_SERVICES") == "1":
        pytest.fail(f"TANGGUH_REQUIRE_SERVICES=1 but {what}")
    pytest.skip(what)


def need_redis():
    for binary in ("redis-server", "redis-cli"):
        if shutil.which(binary) is None:
            missing(f"{binary} is not installed")


class SentinelSetup:
    def __init__(self, root):
        need_redis()
        self.root = root
        os.makedirs(root / "primary")
        os.makedirs(root / "replica")
        self.primary = RedisServer(root / "primary", extra=["--repl-diskless-sync-delay", "0"]).start()
        self.replica = RedisServer(root / "replica", extra=["--replicaof", "127.0.0.1", str(self.primary.port),
                                                            "--repl-ping-replica-period", "1"])
        self.replica.start()
        self.sentinels = [self._sentinel(i) for i in range(3)]
        self.wait_replicated()
        wait_for(lambda: all(self._known(s) for s in self.sentinels), timeout=20,
                 message="every sentinel to know the replica and the other sentinels")

    def _sentinel(self, i):
        folder = self.root / f"sentinel{i}"
        os.makedirs(folder)
        port = free_port()
        conf = folder / "sentinel.conf"
        conf.write_text(f"port {port}\nbind 127.0.0.1\ndir {folder}\n"
                        f"sentinel monitor {SERVICE} 127.0.0.1 {self.primary.port} 2\n"
                        f"sentinel down-after-milliseconds {SERVICE} 1000\n"
                        f"sentinel failover-timeout {SERVICE} 5000\n")
        proc = subprocess.Popen(["redis-server", str(conf), "--sentinel", "--logfile", str(folder / "log")],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        node = RedisServer.__new__(RedisServer)
        node.dir, node.port, node.proc, node.appendonly, node.extra = str(folder), port, proc, False, []
        wait_for(node.ping, timeout=15, message=f"sentinel on port {port} to answer")
        return node

    @staticmethod
    def _known(sentinel):
        with sentinel.client(decode_responses=True) as r:
            fields = r.sentinel_master(SERVICE)
            return int(fields["num-slaves"]) >= 1 and int(fields["num-other-sentinels"]) >= 2

    def wait_replicated(self):
        def caught_up():
            with self.primary.client(decode_responses=True) as r:
                info = r.info("replication")
            return info.get("connected_slaves", 0) >= 1 and info["slave0"]["state"] == "online"
        wait_for(caught_up, timeout=20, message="the replica to be in sync")

    def url(self, prefix, **options):
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        query = "&".join([f"prefix={prefix}"] + [f"{k}={v}" for k, v in options.items()])
        return f"redis+sentinel://{hosts}/{SERVICE}/0?{query}"

    def master_port(self):
        with self.sentinels[0].client(decode_responses=True) as r:
            return int(r.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)[1])

    def kill_primary(self):
        """SIGKILL the primary; returns once the sentinels have promoted the replica."""
        self.primary.stop(signal.SIGKILL)
        wait_for(lambda: self.master_port() == self.replica.port, timeout=30, message="the sentinels' failover")
        wait_for(lambda: self.replica.client().info("replication")["role"] == "master", timeout=30,
                 message="the replica to be promoted")

    def stop(self):
        for node in [*self.sentinels, self.replica, self.primary]:
            if node.proc is not None and node.proc.poll() is None:
                node.proc.kill()
                node.proc.wait(10)


class RedisClusterSetup:
    """Three primaries, three replicas; ``kill_primary_of(key)`` SIGKILLs the primary serving ``key``."""

    def __init__(self, root, nodes=6):
        need_redis()
        self.nodes = []
        for i in range(nodes):
            folder = root / f"node{i}"
            os.makedirs(folder)
            self.nodes.append(RedisServer(folder, extra=[
                "--cluster-enabled", "yes", "--cluster-config-file", str(folder / "nodes.conf"),
                "--cluster-node-timeout", "1000", "--repl-ping-replica-period", "1", "--repl-diskless-sync-delay", "0",
                # A replica of a primary killed mid-test must take over, however long since its last ping.
                "--cluster-replica-validity-factor", "0",
                # The bus port defaults to port + 10000, past 65535 for a high free port.
                "--cluster-port", str(free_port())]).start())
        subprocess.run(["redis-cli", "--cluster", "create", *[f"127.0.0.1:{n.port}" for n in self.nodes],
                        "--cluster-replicas", "1", "--cluster-yes"],
                       check=True, capture_output=True, timeout=60)
        wait_for(self.healthy, timeout=30, message="the cluster to be ok on every node")
        wait_for(self.replicated, timeout=30, message="every replica to be in sync with its primary")

    def replicated(self):
        for n in self.nodes:
            with n.client(decode_responses=True) as r:
                info = r.info("replication")
            if info["role"] == "slave" and info.get("master_link_status") != "up":
                return False
        return True

    def healthy(self):
        live = [n for n in self.nodes if n.proc.poll() is None]
        for n in live:
            with n.client(decode_responses=True) as r:
                if "cluster_state:ok" not in r.execute_command("CLUSTER", "INFO"):
                    return False
        return True

    def url(self, prefix, **options):
        hosts = ",".join(f"127.0.0.1:{n.port}" for n in self.nodes[:2])
        query = "&".join([f"prefix={prefix}"] + [f"{k}={v}" for k, v in options.items()])
        return f"redis+cluster://{hosts}/?{query}"

    def primary_of(self, key):
        live = next(n for n in self.nodes if n.proc.poll() is None)
        with live.client(decode_responses=True) as r:
            slot = r.execute_command("CLUSTER", "KEYSLOT", key)
        for n in self.nodes:
            if n.proc.poll() is not None:
                continue
            with n.client(decode_responses=True) as r:
                for start, end, (_, port, *_rest), *_ in r.execute_command("CLUSTER", "SLOTS"):
                    if start <= slot <= end:
                        return next(m for m in self.nodes if m.port == port)
        raise AssertionError(f"no node serves slot {slot}")

    def kill_primary_of(self, key):
        """SIGKILL the primary serving ``key``; returns once its replica took over."""
        victim = self.primary_of(key)
        victim.stop(signal.SIGKILL)
        wait_for(lambda: self.healthy() and self.primary_of(key) is not victim, timeout=30,
                 message="the replica to take over the killed primary's slots")
        return victim

    def stop(self):
        for n in self.nodes:
            if n.proc is not None and n.proc.poll() is None:
                n.proc.kill()
                n.proc.wait(10)


class PostgresPair:
    """A primary and a streaming replica; ``url(db)`` lists both hosts, read-write sessions only."""

    def __init__(self):
        if _postgres_bin() is None:
            missing("PostgreSQL server binaries are not installed under /usr/lib/postgresql")
        self.primary = PostgresCluster()
        with open(os.path.join(self.primary.data, "postgresql.conf"), "a") as f:
            f.write("wal_level = replica\nmax_wal_senders = 5\n")
        self.primary.start()
        self.replica = PostgresCluster.__new__(PostgresCluster)
        r = self.replica
        r.bindir, r.as_user, r.port = self.primary.bindir, self.primary.as_user, free_port()
        r.root = r.socket_dir = self.primary.root + "-replica"
        r.data = os.path.join(r.root, "data")
        os.makedirs(r.root)
        if r.as_user:
            shutil.chown(r.root, "postgres", "postgres")
        r._pg(["pg_basebackup", "-D", r.data, "-h", "127.0.0.1", "-p", str(self.primary.port), "-U", "postgres",
               "-R", "-X", "stream", "--no-sync"])
        with open(os.path.join(r.data, "postgresql.conf"), "a") as f:
            f.write(f"\nport = {r.port}\nunix_socket_directories = '{r.socket_dir}'\nhot_standby = on\n")
        if r.as_user:
            shutil.chown(os.path.join(r.data, "postgresql.conf"), "postgres", "postgres")
        r.start()

    def url(self, dbname="postgres", **options):
        query = "&".join(["target_session_attrs=read-write"] + [f"{k}={v}" for k, v in options.items()])
        return (f"postgresql://postgres@127.0.0.1:{self.primary.port},127.0.0.1:{self.replica.port}/{dbname}"
                f"?{query}")

    def wait_replicated(self):
        import psycopg

        with psycopg.connect(self.primary.url(), autocommit=True) as db:
            # The insert position, not the write position: these clusters run synchronous_commit = off
            # (tests/servers.py), so a commit that has answered may still sit in the WAL buffers.
            lsn = db.execute("SELECT pg_current_wal_insert_lsn()").fetchone()[0]
        with psycopg.connect(self.replica.url(), autocommit=True) as db:
            wait_for(lambda: db.execute("SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", (lsn,)).fetchone()[0],
                     timeout=30, message="the replica to replay the primary's WAL")

    def promote(self):
        self.replica._pg(["pg_ctl", "-D", self.replica.data, "-w", "-t", "60", "promote"])

    def destroy(self):
        for cluster in (self.replica, self.primary):
            cluster.stop(mode="immediate")
            shutil.rmtree(cluster.root, ignore_errors=True)


class Link:
    """A TCP relay between a replica and its primary that the test can cut: a real partition.

    ``cut()`` stops forwarding the primary's stream (the bytes are dropped, as a
    broken network would), so writes acknowledged by the primary from then on
    never reach the replica.
    """

    def __init__(self, upstream_port):
        import socket
        import threading

        self.upstream = upstream_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.is_cut = threading.Event()
        self.sockets = [self.listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        import socket
        import threading

        while True:
            try:
                down, _ = self.listener.accept()
            except OSError:
                return
            up = socket.create_connection(("127.0.0.1", self.upstream))
            self.sockets += [down, up]
            threading.Thread(target=self._pump, args=(up, down, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(down, up, False), daemon=True).start()

    def _pump(self, src, dst, from_primary):
        try:
            while data := src.recv(65536):
                if not (from_primary and self.is_cut.is_set()):
                    dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass

    def cut(self):
        self.is_cut.set()

    def close(self):
        for s in self.sockets:
            try:
                s.close()
            except OSError:
                pass


class ReplicatedRedis:
    """A primary and a replica replicating through a ``Link``; ``promote()`` makes the replica the primary."""

    def __init__(self, root):
        need_redis()
        os.makedirs(root / "primary")
        os.makedirs(root / "replica")
        self.primary = RedisServer(root / "primary", extra=["--repl-diskless-sync-delay", "0"]).start()
        self.link = Link(self.primary.port)
        self.replica = RedisServer(root / "replica", extra=["--replicaof", "127.0.0.1", str(self.link.port)]).start()
        wait_for(lambda: self.replica.client().info("replication").get("master_link_status") == "up", timeout=20,
                 message="the replica to be in sync")

    def promote(self):
        """The failover: the primary is gone (SIGKILL), the replica answers as the primary."""
        self.primary.stop(signal.SIGKILL)
        self.link.close()
        with self.replica.client() as r:
            r.execute_command("REPLICAOF", "NO", "ONE")

    def stop(self):
        self.link.close()
        for node in (self.replica, self.primary):
            if node.proc is not None and node.proc.poll() is None:
                node.proc.kill()
                node.proc.wait(10)
