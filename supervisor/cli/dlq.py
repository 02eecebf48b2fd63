"""Dead letters: ``dlq list``, ``show``, ``replay``, ``purge``.

``--all`` and ``list --limit 0`` walk the dead jobs a page at a time (100,000
dead jobs with 2 KB payloads loaded whole took over a gigabyte). Replay and
purge report like the bulk actions (``progress``): text lists only the ids
left as they were (``ID conflict``, ``ID not_dead``) above the summary,
``--json`` every id, and a stop partway says how far it got.
"""
import json
import math
import sys
import time

from ..errors import BadInput, NotDead
from ..jobfilter import MAX_LIMIT, JobFilter
from .bulk import PAGE, pages
from .common import UsageError, open_client
from .jobs import get_job, render_error, render_history
from .output import one_line, print_json, printable, say, table, when
from .progress import Progress

NOT_DONE = ("conflict", "not_dead")  # the outcomes text mode lists by id; the rest is the summary's count
MIN_RATE = 0.01  # replays per second, as the web console's replay: one in 100 s


def cmd_dlq_list(args):
    if args.limit < 0:
        raise UsageError("dlq list: --limit must be >= 0")
    if args.limit > MAX_LIMIT:
        raise UsageError(f"dlq list: --limit must be at most {MAX_LIMIT} (0 lists every dead job, page by page)")
    JobFilter(state="dead", type=args.type)  # checked as --limit 0 checks it: `--type ''` was no filter at all
    with open_client(args) as client:
        if args.limit:
            _print_list(args, [client.broker.dlq_list(type=args.type, limit=args.limit)])
        else:  # every dead job: a page at a time, so a huge dead-letter queue never sits in memory whole
            _print_list(args, _dead_pages(client.broker, args.type))


def _dead_pages(broker, type):
    cursor = None
    while True:
        page = broker.search(JobFilter(state="dead", type=type), cursor=cursor, limit=PAGE, order="newest")
        yield page.jobs
        cursor = page.next_cursor
        if cursor is None:
            return


def _print_list(args, pages):
    """Print pages of dead jobs as they come: a JSON array (one element a line) or a table per page."""
    first = True
    for jobs in pages:
        if args.json:
            for job in jobs:
                print(("[" if first else ",") + json.dumps(job.to_dict(), default=str))
                first = False
        elif jobs:
            rows = [[j.id, j.type, j.queue, j.reason, f"{j.attempt}/{j.attempts_allowed}", when(j.last_failure_at),
                     one_line(((j.error or {}).get("class") or "") + ": " + ((j.error or {}).get("message") or ""),
                              50)] for j in jobs]
            text = table(["ID", "TYPE", "QUEUE", "REASON", "ATTEMPTS", "LAST_FAILURE", "ERROR"], rows)
            say(text if first else text.split("\n", 1)[1])  # one header, above the first page
            first = False
        sys.stdout.flush()
    if args.json:
        print("[]" if first else "]")
    elif first:
        print("no dead jobs" + (f" of type {printable(args.type, keep='')}" if args.type else ""))


def dead_job(broker, job_id):
    job = get_job(broker, job_id)
    if job.state != "dead":
        raise NotDead(f"job {job_id} is {job.state}, not dead")
    return job


def selected(broker, args):
    """(batches of ids, how many): the dead jobs ``--all`` (of ``--type``) a page at a time, or the ids
    given, each checked dead before any is touched."""
    if args.all:
        f = JobFilter(state="dead", type=args.type)
        count = broker.count(f)
        return pages(broker, f), count.n, count.exact
    ids = list(dict.fromkeys(args.job_ids))
    for job_id in ids:  # all or nothing: a wrong id changes nothing
        dead_job(broker, job_id)
    return iter([ids]), len(ids), True


def cmd_dlq_show(args):
    with open_client(args) as client:
        job = dead_job(client.broker, args.job_id)
    if args.json:
        print_json(job.to_dict())
        return
    lines = [f"{'id:':<17} {job.id}", f"{'type:':<17} {job.type}", f"{'queue:':<17} {job.queue}",
             f"{'reason:':<17} {job.reason or '-'}",
             f"{'attempts:':<17} {job.attempt} of {job.attempts_allowed}",
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
    if args.rate is not None and not MIN_RATE <= args.rate < math.inf:
        # 1e-300 passed, replayed one job, then its pause overflowed the clock: "stopped after 1".
        raise UsageError(f"dlq replay: --rate must be a number of replays per second, at least {MIN_RATE:g}")
    with open_client(args) as client:
        broker = client.broker
        batches, count, exact = selected(broker, args)
        progress = Progress("dlq replay", args.json, count, exact, per_id=NOT_DONE)
        began, step = time.monotonic(), 1 if args.rate else PAGE
        with progress.running():
            for batch in batches:
                for start in range(0, len(batch), step):
                    if args.rate:
                        pause = began + progress.done / args.rate - time.monotonic()
                        if pause > 0:
                            time.sleep(pause)  # pacing, so a replay storm does not flood the workers
                    progress.report(_replay(broker, batch[start:start + step]))
    progress.finish(_summary("replayed", progress.outcomes))


def _replay(broker, ids):
    """``{id: "replayed" | "conflict" | "not_dead"}``. A batch is all or nothing in the broker, so
    one job whose idempotency key an unfinished job holds sends its batch through one id at a time:
    the others are replayed, it stays dead and is reported, as ``retry`` reports it."""
    try:
        broker.dlq_replay(ids)
        return dict.fromkeys(ids, "replayed")
    except BadInput:  # the broker's word for a held idempotency key
        if len(ids) == 1:
            return {ids[0]: "conflict"}
    except NotDead:
        if len(ids) == 1:
            return {ids[0]: "not_dead"}  # replayed, purged or retried by someone else since it was selected
    return {job_id: outcome for one in ids for job_id, outcome in _replay(broker, [one]).items()}


def _summary(verb, outcomes):
    done = outcomes.get(verb, 0)
    rest = ", ".join(f"{n} {outcome}" for outcome, n in sorted(outcomes.items()) if outcome != verb)
    return f"{verb} {done} job(s)" + (f"; not {verb}: {rest}" if rest else "")


def cmd_dlq_purge(args):
    _selection(args, "purge")
    if args.all and not args.yes:
        raise UsageError("dlq purge: --all deletes every dead job" + (f" of type {args.type}" if args.type else "")
                         + " for good; add --yes to confirm")
    with open_client(args) as client:
        broker = client.broker
        batches, count, exact = selected(broker, args)
        progress = Progress("dlq purge", args.json, count, exact, per_id=NOT_DONE)
        with progress.running():
            for batch in batches:
                for start in range(0, len(batch), PAGE):
                    progress.report(_purge(broker, batch[start:start + PAGE]))
    progress.finish(_summary("purged", progress.outcomes))


def _purge(broker, ids):
    try:
        broker.dlq_purge(ids)
        return dict.fromkeys(ids, "purged")
    except NotDead:  # one of them left the dead letters since it was selected: the rest still go
        if len(ids) == 1:
            return {ids[0]: "not_dead"}
        return {job_id: outcome for one in ids for job_id, outcome in _purge(broker, [one]).items()}
