"""systemd's notify protocol without libsystemd: datagrams to ``$NOTIFY_SOCKET``.

Does nothing when ``NOTIFY_SOCKET`` is unset, so ``tangguh run`` behaves the
same in a terminal. Abstract (``@name``) and path sockets both work.
"""
import os
import socket
import time


class Notifier:
    def __init__(self, env=None):
        env = os.environ if env is None else env
        self.sock = None
        self.address = None
        address = env.get("NOTIFY_SOCKET")
        if address:
            self.address = "\0" + address[1:] if address.startswith("@") else address
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        # Ping at half the watchdog period, as sd_watchdog_enabled(3) advises.
        self.watchdog_every = None
        usec, pid = env.get("WATCHDOG_USEC"), env.get("WATCHDOG_PID")
        if self.sock and usec and usec.isdigit() and (not pid or pid == str(os.getpid())):
            self.watchdog_every = int(usec) / 2e6
        self.last_ping = 0.0
        self.last_status = None

    @property
    def enabled(self):
        return self.sock is not None

    def send(self, *lines):
        if self.sock is None:
            return
        try:
            self.sock.sendto("\n".join(lines).encode(), self.address)
        except OSError:
            pass  # systemd went away or the socket is full: never let this stop the loop

    def ready(self, status=None):
        self.send("READY=1", *([f"STATUS={status}"] if status else []))

    def reloading(self):
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        self.send("RELOADING=1", f"MONOTONIC_USEC={usec}")

    def stopping(self):
        self.send("STOPPING=1")

    def status(self, text):
        if text != self.last_status:
            self.last_status = text
            self.send(f"STATUS={text}")

    def watchdog(self):
        """Call from the main loop each turn; pings at most every half period."""
        if self.watchdog_every is None:
            return
        now = time.monotonic()
        if now - self.last_ping >= self.watchdog_every:
            self.last_ping = now
            self.send("WATCHDOG=1")

    def close(self):
        if self.sock is not None:
            self.sock.close()
            self.sock = None
