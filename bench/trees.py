"""The two revisions of an A/B benchmark, each in a tree of its own.

A revision is checked out into a temporary git worktree (removed afterwards);
None stands for this working tree. The A/B scripts run each side's code with
``PYTHONPATH`` pointing at its tree.
"""
import contextlib
import os
import subprocess
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
