"""Dead letters: ``dlq list``, ``show``, ``replay``, ``purge``."""
import json
import time

from ..errors import NotDead
from .common import UsageError, open_client
from .jobs import get_job, render_error, render_history
from .output import one_line, print_json, say, table, when


def cmd_dlq_list(args):
    if args.limit < 0:
        raise UsageError("dlq list: --limit must be >= 0")
    with open_client(args) as client:
        jobs = client.broker.dlq_list(type=args.type, limit=args.limit or None)
    if args.json:
        print_json([job.to_dict() for job in jobs])
        return
    if not jobs:
        print("no dead jobs" + (f" of type {args.type}" if args.type else ""))
        return
    rows = [[j.id, j.type, j.queue, j.reason, f"{j.attempt}/{j.max_attempts}", when(j.last_failure_at),
             one_line(((j.error or {}).get("class") or "") + ": " + ((j.error or {}).get("message") or ""), 50)]
            for j in jobs]
    say(table(["ID", "TYPE", "QUEUE", "REASON", "ATTEMPTS", "LAST_FAILURE", "ERROR"], rows))


def dead_job(broker, job_id):
    job = get_job(broker, job_id)
    if job.state != "dead":
        raise NotDead(f"job {job_id} is {job.state}, not dead")
    return job


def selected_ids(broker, args):
    """The dead jobs ``--all`` (of ``--type``) or the ids given, each checked dead before any is touched."""
    if args.all:
        return [job.id for job in broker.dlq_list(type=args.type, limit=None)]
    ids = list(dict.fromkeys(args.job_ids))
    for job_id in ids:  # all or nothing: a wrong id changes nothing
        dead_job(broker, job_id)
    return ids


def cmd_dlq_show(args):
    with open_client(args) as client:
        job = dead_job(client.broker, args.job_id)
    if args.json:
        print_json(job.to_dict())
        return
    lines = [f"{'id:':<17} {job.id}", f"{'type:':<17} {job.type}", f"{'queue:':<17} {job.queue}",
             f"{'reason:':<17} {job.reason or '-'}",
             f"{'attempts:':<17} {job.attempt} of {job.max_attempts}",
             f"{'first_failure_at:':<17} {when(job.first_failure_at)}",
             f"{'last_failure_at:':<17} {when(job.last_failure_at)}",
             f"{'payload:':<17} {json.dumps(job.payload, sort_keys=True)}"]
    say("\n".join(lines + render_error(job.error, "error:") + render_history(job.history)))


def _selection(args, verb):
    if args.all and args.job_ids:
        raise UsageError(f"dlq {verb}: give job ids or --all, not both")
    if not args.all and not args.job_ids:
        raise UsageError(f"dlq {verb}: give job ids or --all")
    if args.type and not args.all:
        raise UsageError(f"dlq {verb}: --type only goes with --all")


def cmd_dlq_replay(args):
    _selection(args, "replay")
    if args.rate is not None and not args.rate > 0:
        raise UsageError("dlq replay: --rate must be a positive number of replays per second")
    with open_client(args) as client:
        broker = client.broker
        ids = selected_ids(broker, args)
        if args.rate is None:
            for start in range(0, len(ids), 500):
                broker.dlq_replay(ids[start:start + 500])
        else:
            began = time.monotonic()
            for i, job_id in enumerate(ids):
                pause = began + i / args.rate - time.monotonic()
                if pause > 0:
                    time.sleep(pause)  # pacing, so a replay storm does not flood the workers
                broker.dlq_replay([job_id])
    print(f"replayed {len(ids)} job(s)")


def cmd_dlq_purge(args):
    _selection(args, "purge")
    if args.all and not args.yes:
        raise UsageError("dlq purge: --all deletes every dead job" + (f" of type {args.type}" if args.type else "")
                         + " for good; add --yes to confirm")
    with open_client(args) as client:
        broker = client.broker
        ids = selected_ids(broker, args)
        purged = 0
        for start in range(0, len(ids), 500):
            purged += broker.dlq_purge(ids[start:start + 500])
    print(f"purged {purged} job(s)")
