"""What a child may cost the master: the descriptors its fork takes, the jobs and
the memory it may run up before it is recycled, the processes its jobs start (they
end with it); and what a fork needs: no other thread running in the master."""
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


def own_session():
    """In a child just forked: lead a session of its own, which every process a job starts there
    joins. The master signals that session's group, so a kill ends them with the child: orphaned,
    a `sleep 1000` or a multiprocessing pool ran on under init after every hard timeout. A session
    rather than a group in the master's: that group is not orphaned, so SIGTTIN to every process
    (`systemctl kill -s TTIN`) or a read from the terminal would stop a job's processes; a session
    of its own has no terminal either, so Ctrl-C stays the master's alone."""
    try:
        os.setsid()
    except OSError:
        pass  # refused (a seccomp filter): its kills reach the child alone, as before


def signal_child(pid, sig):
    """``sig`` to a child and the processes its jobs started (its session's group); to the child
    alone when it has no session yet (forked an instant ago). Never raises: it may be gone."""
    for send in (os.killpg, os.kill):
        try:
            send(pid, sig)
            return
        except OSError:
            pass


def reap_any(ours):
    """Reap an ended child process: ``(pid, status)``, ``(0, 0)`` when none has ended
    (``ChildProcessError`` when there is none). What one of ``ours`` (pids) left running in its
    session is killed first, while its zombie still holds the pid: reaped, the pid could name
    another process's group by the time the SIGKILL went."""
    if not hasattr(os, "waitid"):  # not Linux: the group outlives its leader, its id unused meanwhile
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid in ours:
            signal_child(pid, signal.SIGKILL)
        return pid, status
    ended = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    if ended is None or ended.si_pid == 0:
        return 0, 0
    if ended.si_pid in ours:
        signal_child(ended.si_pid, signal.SIGKILL)
    return os.waitpid(ended.si_pid, 0)


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
