"""How an action on many jobs reports: each job's outcome as it happens, a summary, where it stopped.

A bulk action can stop partway (the broker goes away, stdout is closed, a
Ctrl-C): what was already done stays done, so the operator must learn how far
it got. Every batch's outcomes are printed and flushed as soon as the broker
answered (text: ``ID OUTCOME``; ``--json``: one JSON object a line), and a stop
becomes one line on stderr, ``stopped after N of M: REASON``, exit 1 (exit 2
would claim nothing was written; a Ctrl-C exits 130, as any command it ends). A closed stdout stops the action rather
than let ``| head`` silently turn a 100,000-job action into 500.
"""
import collections
import contextlib
import json
import os
import sys

from .common import PROG, Failure
from .output import printable


def stdout_gone():
    """Point stdout at /dev/null: what is still buffered for a closed pipe must not fail the exit."""
    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(fd, sys.stdout.fileno())
        finally:
            os.close(fd)
    except (AttributeError, ValueError, OSError):  # not a real file (a test's capture): nothing to flush at exit
        pass


class Progress:
    """The running report of one action; ``per_id``: which outcomes text mode prints line by line
    (None: all of them; the dlq commands print only the ids that were not done)."""

    def __init__(self, verb, as_json, selected, exact=True, per_id=None):
        self.verb, self.as_json, self.selected, self.exact = verb, as_json, selected, exact
        self.per_id = per_id
        self.outcomes = collections.Counter()
        self.done = 0

    def report(self, got):
        """Print ``{job_id: outcome}`` the broker just answered, and flush."""
        lines = []
        for job_id, outcome in got.items():
            self.outcomes[outcome] += 1
            self.done += 1  # counted before printing: a closed stdout still knows what was done
            if self.as_json:
                lines.append(json.dumps({"id": job_id, "outcome": outcome}))
            elif self.per_id is None or outcome in self.per_id:
                lines.append(printable(f"{job_id} {outcome}", keep=""))
        if lines:
            sys.stdout.write("\n".join(lines) + "\n")
        sys.stdout.flush()

    def summary(self, stopped=None):
        return {"verb": self.verb, "count": self.done, "outcomes": dict(sorted(self.outcomes.items())),
                "stopped": stopped}

    def finish(self, text):
        """The last line: ``text`` (or the JSON summary). All was done even if stdout is gone now."""
        line = json.dumps(self.summary()) if self.as_json else text
        try:
            print(line, flush=True)
        except BrokenPipeError:
            stdout_gone()
            print(f"{text} (stdout closed before this summary)", file=sys.stderr)

    def stopped(self, reason):
        of = f"{'' if self.exact else 'about '}{self.selected}" if self.selected is not None else "?"
        return f"stopped after {self.done} of {of}: {reason}"

    @contextlib.contextmanager
    def running(self):
        """Around the action: whatever ends it early is reported as how far it got."""
        try:
            yield self
        except BrokenPipeError:
            stdout_gone()
            raise Failure(self.stopped("stdout closed")) from None
        except KeyboardInterrupt:  # exit 130, as for any command Ctrl-C ends; the summary first
            self._json_summary("interrupted")
            print(f"{PROG}: {self.stopped('interrupted')}", file=sys.stderr)
            raise
        except Exception as exc:  # noqa: BLE001 - any failure partway: say how far it got
            reason = " ".join(str(exc).split()) or type(exc).__name__
            if not isinstance(exc, (Failure, OSError)) and type(exc).__module__.split(".")[0] != "supervisor":
                reason = f"{type(exc).__name__}: {reason}"
            self._json_summary(reason)
            raise Failure(self.stopped(reason)) from exc

    def _json_summary(self, reason):
        if self.as_json:
            try:
                print(json.dumps(self.summary(reason)), flush=True)
            except BrokenPipeError:
                stdout_gone()
            except OSError:  # the failed write that stopped it fails again (a full disk): stderr says it
                pass
