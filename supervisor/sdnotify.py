"""systemd's notify protocol without libsystemd: datagrams to ``$NOTIFY_SOCKET``.

Does nothing when ``NOTIFY_SOCKET`` is unset, so ``tangguh run`` behaves the
same in a terminal. Abstract (``@name``) and path sockets both work; any other
value is ignored, as sd_notify(3) does.

The socket is non-blocking: a notification is advice to the service manager,
and a manager that stopped reading must never stall the main loop (a stalled
loop is exactly what the watchdog exists to catch).
"""
import os
import socket
import time


class Notifier:
    def __init__(self, env=None):
        env = os.environ if env is None else env
        self.sock = None
        self.address = None
        address = env.get("NOTIFY_SOCKET", "")
        if address.startswith("@") and len(address) > 1:
            self.address = "\0" + address[1:]  # abstract namespace
        elif address.startswith("/"):
            self.address = address
        if self.address is not None:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self.sock.setblocking(False)
        # Ping at half the watchdog period, as sd_watchdog_enabled(3) advises.
        # WATCHDOG_PID names the process meant to ping; when it is another
        # process (we were started by a wrapper), the watchdog is not ours.
        self.watchdog_every = None
        usec, pid = env.get("WATCHDOG_USEC", ""), env.get("WATCHDOG_PID", "")
        if self.sock and usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid())):
            self.watchdog_every = int(usec) / 2e6
        self.last_ping = None
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
            pass  # systemd went away or its queue is full: never let this stop the loop

    def ready(self, status=None):
        if status:
            self.last_status = status
        self.send("READY=1", *([f"STATUS={status}"] if status else []))

    def reloading(self):
        # One datagram: systemd (Type=notify-reload, 253+) matches the reload
        # to the request by this CLOCK_MONOTONIC timestamp.
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        self.send("RELOADING=1", f"MONOTONIC_USEC={usec}")

    def stopping(self):
        self.send("STOPPING=1")

    def status(self, text):
        if text != self.last_status:
            self.last_status = text
            self.send(f"STATUS={text}")

    def next_ping_at(self):
        """The monotonic instant the next WATCHDOG=1 is due (None: no watchdog).

        The main loop must wake up by then even when idle, or a short
        ``WatchdogSec=`` would expire while it sleeps.
        """
        if self.watchdog_every is None:
            return None
        return time.monotonic() if self.last_ping is None else self.last_ping + self.watchdog_every

    def watchdog(self, now_anyway=False):
        """Call from the main loop each turn; pings at most every half period. ``now_anyway``:
        before the loop is held up (the master's own import at a reload), whatever the time."""
        if self.watchdog_every is None:
            return
        now = time.monotonic()
        if now_anyway or self.last_ping is None or now - self.last_ping >= self.watchdog_every:
            self.last_ping = now
            self.send("WATCHDOG=1")

    def close(self):
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        self.watchdog_every = None
