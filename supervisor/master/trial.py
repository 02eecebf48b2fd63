"""A reload imports the handler files first in a throwaway process.

The master imports them itself only once that trial passed. A module that ends
the process importing it (``os._exit``, a signal, a crash in a C extension) or
that waits at import (a server it cannot reach) then fails the reload, with
``reload_error`` saying so, instead of ending the master and every running job
with it, or freezing its loop for as long as the import takes.
"""
import os
import select
import signal
import time

from .. import registry, scheduler
from ..child import worker

# The master's signals: a no-op handler each, the signal's number written to its self-pipe.
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGHUP, signal.SIGTTIN, signal.SIGTTOU,
           signal.SIGCHLD)


def not_the_masters_in_forks(master_pid):
    """Every process the master forks (a child, a trial, a helper a handler module starts at a
    reload's import) begins with the signals of a new process, not the master's: inherited, the
    no-op handlers wrote each signal that helper got into the master's self-pipe, and a SIGTERM
    sent to the helper alone stopped the master. (A child's own forks are the child's business.)"""
    def forked():
        if os.getppid() == master_pid:
            _default_signals()
    os.register_at_fork(after_in_child=forked)


def _default_signals():
    signal.set_wakeup_fd(-1)
    for sig in SIGNALS:
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)


def load(cfg, generation, current, heartbeat, signals=None):
    """The next generation's ``(handlers, dropped types)`` (``registry.reload_handlers``), once a
    trial import of ``cfg``'s handlers folder in a child process passed within its
    ``supervisor.import_timeout``, and its schedules pass ``scheduler.check_schedules``.

    ``signals``: the master's (self-pipe, pending deque): a stop signal that arrives during the
    trial ends it and fails the reload, so the stop is not kept waiting."""
    folder = cfg.supervisor.handlers
    problem = trial(folder, generation, heartbeat, cfg.supervisor.import_timeout, signals)
    if problem:
        raise registry.HandlerLoadError(problem)
    handlers, dropped = registry.reload_handlers(folder, generation, current)
    scheduler.check_schedules(cfg, handlers)
    return handlers, dropped


def trial(folder, generation, heartbeat, timeout, signals=None):
    """What went wrong importing ``folder`` in a forked process, or None when it imported."""
    r, w = os.pipe()
    master_pid = os.getpid()
    running = heartbeat.thread is not None
    heartbeat.stop()  # fork only while no other thread runs (docs/design.md, process-model rules)
    try:
        pid = os.fork()
    except OSError:
        pid = None  # no process to spare (TasksMax=): the master's own import is all there is
    if pid == 0:
        _import_and_leave(r, w, folder, generation, master_pid)
    if running:
        heartbeat.start()
    os.close(w)
    try:
        return None if pid is None else _verdict(pid, r, timeout, signals)
    finally:
        os.close(r)
        if pid:
            try:
                os.killpg(pid, signal.SIGKILL)  # what a module started there (a helper process) goes too
            except OSError:
                pass


def _import_and_leave(r, w, folder, generation, master_pid):
    code = 1
    try:
        os.close(r)
        os.setpgid(0, 0)  # a group of its own: the master ends whatever the import started with it
        worker.set_parent_death_signal(master_pid)  # a master killed meanwhile leaves no import behind
        _default_signals()  # the master's self-pipe: a signal here is not the master's
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        try:
            registry.load_handlers(folder, generation)
            report = b""
        except BaseException as exc:  # noqa: BLE001 - the master's own import reports it in full
            report = type(exc).__name__.encode()
        os.write(w, b"imported\n" + report)
        code = 0
    finally:
        os._exit(code)  # never back into the master's code, no finalizer on what it inherited


def _verdict(pid, r, timeout, signals):
    """Waits for the trial process itself (not for its pipe's end: a helper process a module
    forked may hold that open), for a stop signal, or for ``timeout``."""
    deadline = time.monotonic() + timeout
    watch = [r] + ([signals[0]] if signals else [])
    try:
        exited = os.pidfd_open(pid)
        watch.append(exited)
    except (AttributeError, OSError):  # not Linux 5.3+: look at the process every 50 ms
        exited = None
    out = b""
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return (f"supervisor.handlers: importing the handler files took over {timeout:g}s"
                        " (supervisor.import_timeout); a module waiting at import?")
            ready = select.select(watch, [], [], left if exited is not None else min(left, 0.05))[0]
            if r in ready:
                chunk = os.read(r, 4096)
                out += chunk
                if not chunk:
                    watch.remove(r)  # its end: the process itself says when it is over
            if signals and signals[0] in ready and _stop_among(signals):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return "supervisor.handlers: the reload gave way to a stop signal"
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
    finally:
        if exited is not None:
            os.close(exited)
    os.set_blocking(r, False)
    try:
        out += os.read(r, 4096)  # what it wrote just before it left
    except BlockingIOError:
        pass
    if out.startswith(b"imported\n"):
        return None  # imported, or failed as the master's own import will say in full
    how = f"signal {signal.Signals(os.WTERMSIG(status)).name}" if os.WIFSIGNALED(status) else \
        f"exit code {os.WEXITSTATUS(status)}"
    return f"supervisor.handlers: a handler module ended the process importing it ({how})"


def _stop_among(signals):
    """Read the master's self-pipe (its bytes stay for the loop) and say whether a stop came."""
    fd, pending = signals
    try:
        data = os.read(fd, 4096)
    except BlockingIOError:
        return False
    pending.extend(data)
    return any(sig in data for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT))
