"""What a child may cost the master: the descriptors its fork takes, the jobs and
the memory it may run up before it is recycled; and what a fork needs: no other
thread running in the master."""
import atexit
import errno
import logging
import os
import resource
import signal
import sys
import threading

import psutil

log = logging.getLogger("tangguh.arbiter")

# Never spent on children: the broker's connections, the socket's clients, the log.
# A master out of descriptors could not answer ``tangguh status`` nor reach its broker.
DESCRIPTOR_RESERVE = 32


def check_descriptors(reserve=DESCRIPTOR_RESERVE):
    """Raise ``OSError(EMFILE)`` when a fork now would leave fewer than ``reserve`` descriptors."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return
    try:
        used = len(os.listdir("/proc/self/fd"))
    except OSError:
        return  # no /proc here: the fork's own socketpair reports a shortage
    if used + reserve > soft:
        raise OSError(errno.EMFILE, f"{used} of {soft} file descriptors in use, {reserve} kept for the broker"
                                    " and the socket (LimitNOFILE= raises the limit)")


def how_it_ended(status):
    """A ``waitpid`` status as a log's words: ``"signal SIGKILL"``, ``"exit code 3"``. A real-time
    signal (their default action ends a process) has no ``signal.Signals`` member past SIGRTMIN
    and SIGRTMAX: named from those, never a ValueError in the master's loop."""
    if not os.WIFSIGNALED(status):
        return f"exit code {os.WEXITSTATUS(status)}"
    sig = os.WTERMSIG(status)
    try:
        return f"signal {signal.Signals(sig).name}"
    except ValueError:
        low, high = signal.SIGRTMIN, signal.SIGRTMAX
        return f"signal SIGRTMIN+{sig - low}" if low < sig < high else f"signal {sig}"


def recycle_reason(cfg, c):
    """(reason, what to log) when child ``c`` should be replaced (``cfg``: the supervisor section), else None."""
    if cfg.max_jobs_per_child and c.jobs_done >= cfg.max_jobs_per_child:
        return "max_jobs", f"after {c.jobs_done} jobs (max_jobs_per_child)"
    if cfg.max_child_rss_mb:
        try:
            rss = psutil.Process(c.pid).memory_info().rss
        except (psutil.Error, OSError):  # gone, or no descriptor left to read /proc with
            return None
        if rss > cfg.max_child_rss_mb * 1024 * 1024:
            return "max_rss", f"RSS {rss / 1048576:.1f} MiB over max_child_rss_mb = {cfg.max_child_rss_mb}"
    return None


def warn_of_threads(seen):
    """Log once per set of names when threads other than the main one run at a fork (one a
    handler module started at import: a lock it holds at the fork stays held in every
    child). Returns the set, for the next call."""
    # By ident: a reload that imports the module again starts another thread of the same name.
    others = frozenset((t.ident, t.name) for t in threading.enumerate() if t is not threading.main_thread())
    if others and not others <= seen:
        log.error("forking beside threads a handler module started (%s): a lock one of them holds at the fork"
                  " stays held in every child; start them lazily, in the job",
                  ", ".join(sorted(name for _, name in others)), extra={"event": "fork_beside_threads"})
    return others


def leave(code):
    """End the stopped master with ``code``. A thread a handler module started without
    ``daemon=True`` would keep it alive (Python waits for such threads at exit) until
    systemd's SIGKILL: name them, run the exit handlers, and leave without waiting."""
    stuck = sorted(t.name for t in threading.enumerate()
                   if t is not threading.main_thread() and not t.daemon and t.is_alive())
    if not stuck:
        return code
    log.warning("not waiting for %d thread(s) a handler module started: %s", len(stuck), ", ".join(stuck),
                extra={"event": "threads_left"})
    atexit._run_exitfuncs()  # logging's flush among them
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
