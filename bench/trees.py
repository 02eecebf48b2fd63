"""The two revisions of an A/B benchmark, each in a tree of its own.

A revision is checked out into a temporary git worktree (removed afterwards);
None stands for this working tree. The A/B scripts run each side's code with
``PYTHONPATH`` pointing at its tree, round after round (``ab_rounds``).
"""
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@contextlib.contextmanager
def checked_out(revisions, prefix):
    """``{label: (path, name)}`` for ``{label: revision or None}``, the worktrees removed on exit."""
    made, trees = [], {}
    try:
        for label, rev in revisions.items():
            if rev is None:
                head = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                                      text=True, check=True).stdout.strip()
                trees[label] = (ROOT, f"working tree (at {head})")
                continue
            path = tempfile.mkdtemp(prefix=f"{prefix}-{label}-")
            subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", "-q", path, rev], check=True)
            made.append(path)
            trees[label] = (path, rev)
        yield trees
    finally:
        for path in made:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", path], check=False)


def broker_list(parser, text, known):
    """The brokers a comma-separated ``--broker`` names; an unknown one is the parser's error."""
    brokers = [b.strip() for b in text.split(",")]
    unknown = [b for b in brokers if b not in known]
    if unknown:
        parser.error(f"unknown broker {unknown[0]!r} (expected {', '.join(known)})")
    return brokers


def ab_rounds(revisions, prefix, brokers, rounds, ev):
    """The rounds of an interleaved A/B, ``rounds`` per broker: yields ``(trees, figures, sides, tmp)``,
    the round's dict to fill (broker, round, load average), the order to run the sides in
    (alternating, ABBA: neither always runs first) and a scratch folder. The worktrees, the folder
    and the evidence ``ev`` are cleaned up when the loop ends, a SIGTERM included."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    ev.r.ping()
    tmp = tempfile.mkdtemp(prefix=f"{prefix}-run-")
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, tmp, ignore_errors=True)
        stack.callback(ev.clear)
        trees = stack.enter_context(checked_out(revisions, prefix))
        for broker in brokers:
            for r in range(rounds):
                figures = {"broker": broker, "round": r + 1, "loadavg": round(os.getloadavg()[0], 2)}
                yield trees, figures, ("A", "B") if r % 2 == 0 else ("B", "A"), tmp
