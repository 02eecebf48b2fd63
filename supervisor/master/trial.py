"""A reload imports the handler files first in a throwaway process.

The master imports them itself only once that trial passed. A module that ends
the process importing it (``os._exit``, a signal, a crash in a C extension) or
that waits at import (a server it cannot reach) then fails the reload, with
``reload_error`` saying so, instead of ending the master and every running job
with it, or freezing its loop for as long as the import takes: the loop watches
the trial's descriptors and serves on meanwhile (``reloads``).
"""
import json
import os
import select
import signal
import time

from .. import childlimits, registry
from ..child import worker

# The master's signals: a no-op handler each, the signal's number written to its self-pipe.
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGHUP, signal.SIGTTIN, signal.SIGTTOU,
           signal.SIGCHLD)
# Sent to every process of the service, they are for the master: caught and dropped elsewhere.
THE_MASTERS = (signal.SIGHUP, signal.SIGINT, signal.SIGTTIN, signal.SIGTTOU)
IMPORTING, IMPORTED = b"importing ", b"imported"  # the trial's lines on its pipe


def not_the_masters_in_forks(master_pid, listeners):
    """Every process the master forks (a child, a trial, a helper a handler module starts at a
    reload's import) begins with signals of its own, not the master's: inherited, the no-op
    handlers wrote each signal that helper got into the master's self-pipe, and a SIGTERM sent to
    the helper alone stopped the master. SIGHUP and SIGINT sent to the whole group (a reload by
    `systemctl kill -s HUP`, Ctrl-C) are the master's: caught and dropped, as a child does once it
    runs, so that neither ends a child still starting. SIGTTIN and SIGTTOU likewise: `systemctl
    kill -s TTIN` signals every process of the service, and their default action stopped the
    trial (its own process group is not orphaned), which then ran out of its time and failed the
    start or the reload. (A child's own forks are its business.)

    Nor does such a process keep the master's ``listeners()`` (the health socket, the metrics
    port): a helper forked by a reload's import held them, and once the master was killed a new
    master found its socket taking connections nobody answered ("another supervisor is running",
    exit 3) and its port taken."""
    def forked():
        if os.getppid() == master_pid:
            _default_signals()
            for server in listeners():
                server.close_in_child()
    os.register_at_fork(after_in_child=forked)


def _default_signals():
    signal.set_wakeup_fd(-1)
    for sig in SIGNALS:
        signal.signal(sig, worker.not_ours if sig in THE_MASTERS else signal.SIG_DFL)


class Trial:
    """A trial import of ``folder`` under way in a forked process: ``poll()`` says how it went.

    The master's loop watches ``fds()`` and looks again at ``due_at()``; ``wait()`` blocks
    instead (at start, and the command line's trial: ``heartbeat`` None, no thread to stop).
    A fork the system refuses (TasksMax=) makes no process: the trial has passed at once,
    and the master's own import is all there is."""

    def __init__(self, folder, generation, heartbeat, timeout):
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.out, self.eof, self.pidfd, self.ended_with = b"", False, None, None
        self.r, w = os.pipe()
        master_pid = os.getpid()
        running = heartbeat is not None and heartbeat.thread is not None
        if heartbeat is not None:
            heartbeat.stop()  # fork only while no other thread runs (docs/design.md, process-model rules)
        try:
            self.pid = os.fork()
        except OSError:
            self.pid = None
        if self.pid == 0:
            _import_and_leave(self.r, w, folder, generation, master_pid)
        if running:
            heartbeat.start()
        # It leads a process group of its own (_import_and_leave); the master's reaping of any
        # child may take its exit status first, and hands it to ``exited``.
        self.group = self.leader = self.pid
        os.close(w)
        os.set_blocking(self.r, False)
        if self.pid is not None:
            try:
                self.pidfd = os.pidfd_open(self.pid)  # readable once the process itself has ended
            except (AttributeError, OSError):  # not Linux 5.3+: looked at every 50 ms
                pass

    def fds(self):
        return [fd for fd in (self.r, self.pidfd) if fd is not None]

    def due_at(self):
        """When the loop must look again without a descriptor saying so."""
        return self.deadline if self.pidfd is not None else min(self.deadline, time.monotonic() + 0.05)

    def poll(self):
        """None while the import runs; once over, what went wrong, or "" when it imported (then
        ``close()``). Over means the process itself ended (not its pipe: a helper process a
        module forked may hold that open) or the time ran out."""
        if self.pid is None:
            return ""
        self._read()
        done, status = (self.pid, self.ended_with) if self.ended_with is not None else os.waitpid(self.pid, os.WNOHANG)
        if not done:
            if time.monotonic() < self.deadline:
                return None
            at = self._importing()
            return (f"supervisor.handlers: {at}: importing it took over {self.timeout:g}s" if at else
                    f"supervisor.handlers: importing the handler files took over {self.timeout:g}s") + \
                " (supervisor.import_timeout); a module waiting at import?"
        self._read()  # what it wrote just before it left
        self.pid = None  # reaped: close() ends only what it left behind
        if IMPORTED in self.out.split(b"\n"):
            return ""  # imported, or failed as the master's own import will say in full
        how = childlimits.how_it_ended(status)
        at = self._importing()
        return (f"supervisor.handlers: {at}: the module ended the process importing it ({how})" if at else
                f"supervisor.handlers: a handler module ended the process importing it ({how})")

    def _importing(self):
        """The file the trial was importing when it ended or ran out of time (a line before each,
        ``_import_and_leave``), or None: among many files, "a handler module" named none."""
        lines = [line for line in self.out.split(b"\n") if line.startswith(IMPORTING)]
        return json.loads(lines[-1][len(IMPORTING):]) if lines else None

    def exited(self, status):
        """Its exit status, reaped by someone else (the master's pool reaps every child)."""
        self.ended_with = status

    def wait(self):
        """``poll()``, blocking until the import is over; then ``close()``."""
        try:
            while (problem := self.poll()) is None:
                select.select(self.fds(), [], [], max(0.0, self.due_at() - time.monotonic()))
            return problem
        finally:
            self.close()

    def close(self):
        """Ends the trial: its process, what a module started there (a helper process: the
        process group, which outlives its leader), its descriptors."""
        if self.group is not None:
            if self.pid is not None and self.ended_with is None:
                _end_children(self.pid)  # its import never finished (out of time, a stop): it could not
            try:
                os.killpg(self.group, signal.SIGKILL)
            except OSError:
                pass
            self.group = None
        if self.pid is not None:
            if self.ended_with is None:  # else reaped by the master's pool: its pid may be another's now
                try:
                    os.kill(self.pid, signal.SIGKILL)  # not in its group yet, if it was that quick
                    os.waitpid(self.pid, 0)
                except OSError:
                    pass
            self.pid = None
        for fd in self.fds():
            os.close(fd)
        self.r = self.pidfd = None

    def _read(self):
        while self.r is not None and not self.eof:
            try:
                chunk = os.read(self.r, 4096)
            except BlockingIOError:
                return
            self.out += chunk
            self.eof = not chunk  # not the trial's end: a helper process a module forked may hold it open


def trial(folder, generation, heartbeat, timeout):
    """What went wrong importing ``folder`` in a forked process, or None when it imported
    (``heartbeat``: the master's, stopped around the fork, or None)."""
    return Trial(folder, generation, heartbeat, timeout).wait() or None


def _import_and_leave(r, w, folder, generation, master_pid):
    code = 1
    try:
        os.close(r)
        os.setpgid(0, 0)  # a group of its own: the master ends whatever the import started with it
        worker.set_parent_death_signal(master_pid)  # a master killed meanwhile leaves no import behind
        _default_signals()  # the master's self-pipe: a signal here is not the master's
        def importer(path, module_name):
            # Its name first (JSON: one line, whatever the name holds), for the verdict to cite.
            os.write(w, IMPORTING + json.dumps(path).encode() + b"\n")
            return registry._import_path(path, module_name)  # the default, as load_handlers uses it

        try:
            registry.load_handlers(folder, generation, importer)
            report = b""
        except BaseException as exc:  # noqa: BLE001 - the master's own import reports it in full
            report = type(exc).__name__.encode()
        _end_children("self")
        os.write(w, IMPORTED + b"\n" + report)
        code = 0
    finally:
        os._exit(code)  # never back into the master's code, no finalizer on what it inherited


def _end_children(pid):
    """The helper processes the import started, ended (by the trial, or by ``close()`` while the
    trial, ``pid``, still runs). ``close()`` kills the trial's process group, which a helper started
    in a session of its own (``start_new_session=True``, a sidecar server) has left: it ran on, one
    more at every start and every reload. The trial is a fork with no child of its own, so each
    child it has is a module's."""
    pids = set()
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                pids.update(int(pid) for pid in f.read().split())
    except OSError:  # no /proc (not Linux): the process group's kill is all there is
        return
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
