"""Private Redis and PostgreSQL servers the tests may stop and start at will.

The shared servers on 6379/5432 serve every other test; outage and chaos tests
restart their broker, so they get servers of their own on free ports:

* ``RedisServer``: ``redis-server`` as a child process, no persistence (a
  restart loses the data unless ``appendonly=True``).
* ``PostgresCluster``: a throwaway cluster made with ``initdb`` in a temp dir,
  run with ``pg_ctl``, listening on 127.0.0.1 and a socket in the same dir.
  PostgreSQL refuses to run as root, so when the tests run as root the
  cluster's files belong to the ``postgres`` OS user and its commands run
  through ``runuser``.

Both have ``stop()``, ``start()`` and ``restart()`` and wait with a deadline
until the server answers (or is gone), never with a bare sleep.
"""
import glob
import os
import pwd
import random
import shutil
import signal
import socket
import subprocess
import tempfile

import psutil
import pytest

from .util import wait_for


_HANDED_OUT = set()  # a port given but not bound yet (a cluster node's port and its bus port) is not given again


def free_port():
    """A port nobody listens on, from this pytest-xdist worker's own thousand in 20000-27999,
    below the kernel's ephemeral ports. A port the kernel picks (``bind(0)``) came back to
    the next caller often, and two workers starting servers at once could get the same one."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    low = 20000 + (int(worker[2:] or 0) % 8) * 1000
    if len(_HANDED_OUT) > 500:
        _HANDED_OUT.clear()  # long bound or gone by now
    for port in random.sample(range(low, low + 1000), 1000):
        if port in _HANDED_OUT:
            continue
        _HANDED_OUT.add(port)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {low}-{low + 999}")


def _answers(port):
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


class RedisServer:
    """``tls=True``: the port speaks TLS only, with a self-signed certificate for 127.0.0.1
    made here by ``openssl`` (``url`` is a ``rediss`` URL that trusts it)."""

    tls = False  # also for nodes made without __init__ (ha_servers' Sentinels)

    def __init__(self, workdir, appendonly=False, extra=(), tls=False):
        self.dir = str(workdir)
        self.port = free_port()
        self.appendonly = appendonly
        self.extra = list(extra)  # more redis-server options (replicaof, cluster-enabled...)
        self.proc = None
        self.tls = tls
        self.url = f"redis://127.0.0.1:{self.port}/0"
        if tls:
            self.cert = os.path.join(self.dir, "tls.pem")
            self.url = f"rediss://127.0.0.1:{self.port}/0?ssl_ca_certs={self.cert}&ssl_cert_reqs=required"

    def start(self):
        ports = ["--port", str(self.port)]
        if self.tls:
            if not os.path.exists(self.cert):
                self._certificate()
            ports = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", self.cert,
                     "--tls-key-file", os.path.join(self.dir, "tls.key"), "--tls-ca-cert-file", self.cert,
                     "--tls-auth-clients", "no"]
        cmd = ["redis-server", *ports, "--bind", "127.0.0.1", "--save", "",
               "--appendonly", "yes" if self.appendonly else "no", "--appendfsync", "always",
               "--dir", self.dir, "--daemonize", "no", "--logfile", os.path.join(self.dir, "redis.log"), *self.extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(self.ping, timeout=15, message=f"redis on port {self.port} to answer")
        return self

    def _certificate(self):
        os.makedirs(self.dir, exist_ok=True)
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                        "-nodes", "-days", "2", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                        "-keyout", os.path.join(self.dir, "tls.key"), "-out", self.cert],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def ping(self):
        import redis

        if self.proc.poll() is not None:
            raise AssertionError(f"redis-server exited with {self.proc.returncode}: {self._log_tail()}")
        try:
            with self.client(socket_timeout=1) as r:
                return r.ping()
        except redis.RedisError:
            return False

    def _log_tail(self):
        try:
            with open(os.path.join(self.dir, "redis.log")) as f:
                return " | ".join(f.read().splitlines()[-3:])
        except OSError:
            return "no log"

    def stop(self, sig=signal.SIGTERM):
        """Stop the server: SIGTERM is a clean shutdown (the AOF is complete), SIGKILL a crash."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(30)
        wait_for(lambda: not _answers(self.port), timeout=10, message="redis port to close")

    def restart(self):
        self.stop()
        return self.start()

    def client(self, **kw):
        import redis

        if self.tls:
            kw = {"ssl": True, "ssl_ca_certs": self.cert, "ssl_cert_reqs": "required", **kw}
        return redis.Redis(host="127.0.0.1", port=self.port, **kw)


def _postgres_bin():
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if not found:
        return None
    return os.path.dirname(found[-1])


class PostgresCluster:
    """A private PostgreSQL cluster; ``url(dbname)`` connects as the superuser ``postgres``."""

    def __init__(self):
        self.bindir = _postgres_bin()
        if self.bindir is None:
            raise RuntimeError("no PostgreSQL server binaries under /usr/lib/postgresql")
        self.port = free_port()
        self.root = tempfile.mkdtemp(prefix="tangguh-pg-")
        self.data = os.path.join(self.root, "data")
        self.socket_dir = self.root
        self.as_user = []
        self.frozen = []  # the processes freeze() stopped
        if os.geteuid() == 0:
            user = pwd.getpwnam("postgres")
            os.chown(self.root, user.pw_uid, user.pw_gid)
            self.as_user = ["runuser", "-u", "postgres", "--"]
        self._pg(["initdb", "-D", self.data, "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync",
                  "--no-instructions"])
        with open(os.path.join(self.data, "postgresql.conf"), "a") as f:
            f.write(f"\nport = {self.port}\nlisten_addresses = '127.0.0.1'\n"
                    f"unix_socket_directories = '{self.socket_dir}'\n"
                    # Fast start and stop; durability is not what these tests measure.
                    "fsync = off\nsynchronous_commit = off\nfull_page_writes = off\n"
                    "max_connections = 200\nshared_buffers = 32MB\n")

    def _pg(self, args, check=True):
        cmd = self.as_user + [os.path.join(self.bindir, args[0]), *args[1:]]
        return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=120)

    def url(self, dbname="postgres"):
        return f"postgresql://postgres@127.0.0.1:{self.port}/{dbname}"

    def start(self):
        self._pg(["pg_ctl", "-D", self.data, "-l", os.path.join(self.root, "server.log"), "-w", "-t", "60",
                  "start"])
        wait_for(self.ping, timeout=30, message=f"postgres on port {self.port} to answer")
        return self

    def ping(self):
        import psycopg

        try:
            with psycopg.connect(self.url(), connect_timeout=2):
                return True
        except psycopg.Error:
            return False

    def stop(self, mode="fast"):
        """Stop the server: ``fast`` ends every session and shuts down cleanly, ``immediate`` like a crash."""
        self._pg(["pg_ctl", "-D", self.data, "-m", mode, "-w", "-t", "60", "stop"], check=False)
        wait_for(lambda: not _answers(self.port), timeout=30, message="postgres port to close")

    def restart(self):
        self.stop()
        return self.start()

    def freeze(self):
        """SIGSTOP the postmaster, then every process it started: a server that hangs instead of dying
        (its sockets stay open and the kernel acks what clients send). ``thaw`` undoes it."""
        with open(os.path.join(self.data, "postmaster.pid")) as f:
            postmaster = psutil.Process(int(f.readline()))
        postmaster.suspend()  # first: it forks no backend after the list below is taken
        self.frozen = [postmaster, *postmaster.children(recursive=True)]
        for p in self.frozen[1:]:
            p.suspend()

    def thaw(self):
        for p in reversed(self.frozen):
            try:
                p.resume()
            except psutil.NoSuchProcess:
                pass
        self.frozen = []

    def destroy(self):
        self.thaw()
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


# -- fixtures (import them into a test module to use them) ------------------------------------------
def _missing(what):
    if os.environ.get("TANGGUH_REQUIRE_SERVICES") == "1":
        pytest.fail(f"TANGGUH_REQUIRE_SERVICES=1 but {what}")
    pytest.skip(what)


@pytest.fixture(scope="session")
def private_redis(tmp_path_factory):
    """A Redis server of the session's own, with an append-only file so a restart keeps the jobs."""
    if shutil.which("redis-server") is None:
        _missing("redis-server is not installed")
    server = RedisServer(tmp_path_factory.mktemp("redis"), appendonly=True).start()
    yield server
    server.stop(signal.SIGKILL)


@pytest.fixture(scope="session")
def private_postgres():
    """A PostgreSQL cluster of the session's own (initdb takes a few seconds: made once)."""
    if _postgres_bin() is None:
        _missing("PostgreSQL server binaries are not installed under /usr/lib/postgresql")
    cluster = PostgresCluster().start()
    yield cluster
    cluster.destroy()
