"""Workflows on the command line: ``tangguh batch ID``, and a job's dependencies in ``tangguh job``."""
import collections

from ..errors import BadInput
from .common import Failure, open_client
from .output import print_json, say

SHOWN = 20  # parents listed one by one in ``tangguh job``; past that, only the counts


def cmd_batch(args):
    from ..workflows import batch_status

    with open_client(args) as client:
        try:
            status = batch_status(client.broker, args.batch_id)
        except BadInput as exc:
            raise Failure(str(exc)) from None
    if args.json:
        print_json(status.to_dict())
        return
    say("\n".join(f"{name + ':':<17} {value}" for name, value in (
        ("batch", status.id), ("callback", status.callback_state), ("total", status.total),
        ("pending", status.pending), ("done", status.done), ("dead", status.dead),
        ("cancelled", status.cancelled), ("expired", status.expired))))


def render_parents(job):
    """The lines of ``tangguh job`` about what the job waits on (none without ``depends_on``)."""
    if job.parents is None:
        return []
    counts = collections.Counter(state or "pending" for state, _ in job.parents.values())
    lines = [f"{'depends_on:':<17} {len(job.parents)} job(s): "
             + ", ".join(f"{n} {state}" for state, n in sorted(counts.items()))]
    for parent, (state, _) in sorted(job.parents.items())[:SHOWN]:
        lines.append(f"  {parent} {state or 'pending'}")
    if len(job.parents) > SHOWN:
        lines.append(f"  ... {len(job.parents) - SHOWN} more")
    return lines
