"""Job control on the command line: ``queue list|pause|resume``, ``supervisors``, ``job ID --wait``.

Every one of them talks to the broker, not to a supervisor's socket, so it
works from any machine that reaches the broker and sees every supervisor
sharing it.
"""
import getpass
import math
import socket
import sys
import time

from ..errors import BadInput
from ..model import DONE, check_queue
from .common import Failure, open_client
from .output import print_json, say, table, when

WAIT_FOREVER_STEP = 3600.0  # seconds per broker wait when no --timeout is given
EXIT_TIMEOUT = 124  # like timeout(1)


def add_commands(commands, command, as_json):
    """The parsers of this module's commands (``command`` is build_parser's helper)."""
    queue = command(commands, "queue", None, "list, pause and resume queues (for every supervisor)")
    sub = queue.add_subparsers(dest="queue_command", metavar="COMMAND", required=True)
    command(sub, "list", cmd_queue_list, "list the broker's queues: paused or not, with their counts", as_json)
    for name, func, text in (("pause", cmd_queue_pause, "stop every supervisor claiming from a queue"
                                                         " (running jobs finish)"),
                             ("resume", cmd_queue_resume, "let supervisors claim from a paused queue again")):
        command(sub, name, func, text).add_argument("name", metavar="NAME")
    command(commands, "supervisors", cmd_supervisors, "list every supervisor sharing the broker", as_json)


def add_job_options(p):
    p.add_argument("--wait", action="store_true",
                   help="wait until the job finishes (exit 0 done, 1 dead/cancelled/expired, 124 timeout)")
    p.add_argument("--timeout", type=float, metavar="S", help="with --wait: give up after S seconds")


def operator():
    """Who is acting, for the records: user@host."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def cmd_queue_list(args):
    with open_client(args) as client:
        broker = client.broker
        names = broker.queues()
        paused = broker.paused()
        stats = broker.stats(names) if names else {}
    if args.json:
        print_json([dict(stats[q].to_dict(), paused_by=paused.get(q, {}).get("by"),
                         paused_at=paused.get(q, {}).get("at")) for q in names])
        return
    if not names:
        print("no queues")
        return
    rows = [[q, "paused" if q in paused else "active", paused.get(q, {}).get("by") or "-", stats[q].ready,
             stats[q].scheduled, stats[q].waiting, stats[q].in_flight, stats[q].dead, stats[q].cancelled,
             stats[q].expired] for q in names]
    say(table(["QUEUE", "STATE", "PAUSED_BY", "READY", "SCHEDULED", "WAITING", "IN_FLIGHT", "DEAD", "CANCELLED",
               "EXPIRED"], rows))


def _known_queue(client, name):
    """A queue the broker knows (its jobs, pauses, supervisors) or the config names: a configured
    queue can be paused before its first job or supervisor (a deploy's supervisors stopped)."""
    check_queue(name)
    known = sorted(set(client.broker.queues()) | set(client.queues))
    if name not in known:
        raise BadInput(f"unknown queue {name!r} (the broker and the config know {', '.join(known) or 'no queue'})")


def cmd_queue_pause(args):
    with open_client(args) as client:
        _known_queue(client, args.name)
        client.pause(args.name, by=operator())
    print(f"paused {args.name}: supervisors stop claiming from it within one poll; running jobs finish")


def cmd_queue_resume(args):
    with open_client(args) as client:
        _known_queue(client, args.name)
        client.resume(args.name)
    print(f"resumed {args.name}")


def cmd_supervisors(args):
    with open_client(args) as client:
        records = client.broker.supervisors()
    if args.json:
        print_json(records)
        return
    if not records:
        print("no supervisors")
        return
    rows = []
    for r in records:
        workers = r.get("workers") or []
        busy = sum(1 for w in workers if isinstance(w, dict) and w.get("job_id"))
        queues = [q for q in r.get("queues") or [] if isinstance(q, str)]
        paused = [q for q in r.get("paused") or r.get("paused_queues") or [] if isinstance(q, str)]
        rows.append([r.get("id"), r.get("host") or "-", r.get("pid") or "-", "gone" if r["gone"] else "live",
                     ",".join(queues) or "-", ",".join(paused) or "-", f"{busy}/{len(workers)}",
                     r.get("version") or "-", when(r["last_heartbeat"])])
    say(table(["ID", "HOST", "PID", "STATE", "QUEUES", "PAUSED", "BUSY", "VERSION", "LAST_HEARTBEAT"], rows))


def wait_job(client, job_id, timeout):
    """The finished job, or None once ``timeout`` seconds passed (None: wait for as long as it takes)."""
    if timeout is not None and not timeout >= 0:
        raise BadInput(f"--timeout must be a number of seconds >= 0, got {timeout}")
    if timeout == math.inf:  # for as long as it takes, as without --timeout
        timeout = None
    if client.broker.get(job_id) is None:
        raise Failure(f"job {job_id} not found")
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        step = WAIT_FOREVER_STEP if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            job = client.wait(job_id, step)
        except BadInput:
            if client.broker.get(job_id) is None:  # an answer about the job, not the command line: exit 1
                raise Failure(f"job {job_id} not found (deleted while waiting)") from None
            raise
        if job is not None or deadline is not None:
            return job


def exit_code(job, job_id, timeout):
    """0 done, 1 dead/cancelled/expired, 124 not finished in time (with a line on stderr)."""
    if job is None:
        print(f"tangguh: job {job_id} not finished after {timeout:g}s", file=sys.stderr)
        return EXIT_TIMEOUT
    return 0 if job.state == DONE else 1  # wait returns finished jobs only: dead, cancelled or expired
