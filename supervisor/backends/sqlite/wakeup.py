"""Waking an idle supervisor on another process's commit: inotify on the WAL file (Linux).

Every commit, by any process, writes the WAL, so an enqueue wakes an idle
supervisor at once instead of at its next poll. Commits that change nothing
(an empty claim) write no WAL, so an idle supervisor does not wake itself.
Elsewhere (no inotify) the supervisor polls.
"""
import ctypes
import os

_IN_MODIFY = 0x00000002


def watch_modifications(paths):
    """A non-blocking inotify fd reporting writes to ``paths``; None without inotify."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
    except (OSError, AttributeError):
        return None
    if fd < 0:
        return None
    for path in paths:
        if libc.inotify_add_watch(fd, os.fsencode(path), _IN_MODIFY) < 0:
            os.close(fd)
            return None
    return fd


def drain(fd):
    """Read every pending event without blocking."""
    try:
        while os.read(fd, 65536):
            pass
    except BlockingIOError:
        pass
