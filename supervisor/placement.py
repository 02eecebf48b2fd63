"""The CPU a new child is pinned to under ``supervisor.cpu_affinity = "spread"`` (docs/operating.md).

Chosen here, in the master, where every child's CPU is known. A child's slot number
alone would not spread them: a replacement started while the child it replaces
still finishes its last job (a recycle, a reload) takes a slot past the pool's
size, and two live children would share one CPU while another had none.
"""
import collections
import os


def cpu_for(setting, children):
    """The CPU of the supervisor's set held by the fewest of ``children`` that stay (the lowest
    on a tie), or None: the setting is "off", or the system has no CPU affinity."""
    if setting != "spread" or not hasattr(os, "sched_getaffinity"):
        return None
    try:
        cpus = sorted(os.sched_getaffinity(0))  # taskset, systemd's CPUAffinity=, the cpuset: never a child's pin
    except OSError:
        return None  # a policy refusing even the read: the child starts unpinned rather than not at all
    held = collections.Counter(c.cpu for c in children if not c.retiring)
    return min(cpus, key=lambda cpu: (held[cpu], cpu))
