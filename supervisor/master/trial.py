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

from .. import registry
from ..child import worker


def load(folder, generation, current, heartbeat, timeout):
    """The next generation's ``(handlers, dropped types)`` (``registry.reload_handlers``), once a
    trial import of ``folder`` in a child process passed within ``timeout`` seconds."""
    problem = trial(folder, generation, heartbeat, timeout)
    if problem:
        raise registry.HandlerLoadError(problem)
    return registry.reload_handlers(folder, generation, current)


def trial(folder, generation, heartbeat, timeout):
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
        return None if pid is None else _verdict(pid, r, timeout)
    finally:
        os.close(r)


def _import_and_leave(r, w, folder, generation, master_pid):
    code = 1
    try:
        os.close(r)
        worker.set_parent_death_signal(master_pid)  # a master killed meanwhile leaves no import behind
        signal.set_wakeup_fd(-1)  # the master's self-pipe: a signal here is not the master's
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        try:
            registry.load_handlers(folder, generation)
            report = b""
        except BaseException as exc:  # noqa: BLE001 - the master's own import reports it in full
            report = type(exc).__name__.encode()
        os.write(w, b"imported\n" + report)
        code = 0
    finally:
        os._exit(code)  # never back into the master's code, no finalizer on what it inherited


def _verdict(pid, r, timeout):
    deadline = time.monotonic() + timeout
    out = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return (f"supervisor.handlers: importing the handler files took over {timeout:g}s"
                    " (supervisor.import_timeout); a module waiting at import?")
        if select.select([r], [], [], left)[0]:
            chunk = os.read(r, 4096)
            if not chunk:
                break
            out += chunk
    _, status = os.waitpid(pid, 0)
    if out.startswith(b"imported\n"):
        return None  # imported, or failed as the master's own import will say in full
    how = f"signal {signal.Signals(os.WTERMSIG(status)).name}" if os.WIFSIGNALED(status) else \
        f"exit code {os.WEXITSTATUS(status)}"
    return f"supervisor.handlers: a handler module ended the process importing it ({how})"
