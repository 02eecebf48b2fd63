"""The PostgreSQL broker's statements on the hot paths, built once per schema.

``ack``/``retry``/``dead``/``release`` are one fenced ``UPDATE`` each (id +
token + state running); ``extend`` is one ``UPDATE ... FROM unnest`` for the
whole batch, and so is ``ack_many``; ``enqueue`` is one ``INSERT ... SELECT
FROM unnest ... ON CONFLICT DO NOTHING``. Enqueue, release and a retry that is
due at once send ``NOTIFY`` on the broker's channel (payload: the queue).

The arrays of those batch statements go in binary (``%b``): psycopg writes an
array's text form in Python, quoting and escaping every element that needs it
(a JSON text, "null"), and that was half the CPU of an ack and two thirds of a
batch enqueue on the client (bench/README.md, "A twelfth machine").
"""

NOW = "date_part('epoch', now())"  # the server's clock, epoch seconds (double precision)
# model.first_token for ``i.token``: a job whose id the caller chose starts from the later of the
# producer's clock and the server's (2**-20 s units): a lagging producer (another host, a clock
# stepped back) cannot give it the tokens of a deleted job's leases. The statement's own clock,
# not now(): a producer's transaction may have begun before the delete.
FIRST_TOKEN = ("CASE WHEN i.token = 0 THEN 0"
               " ELSE GREATEST(i.token, floor(date_part('epoch', clock_timestamp()) * 1048576)::bigint) END")
UNFINISHED = "('queued', 'running', 'retrying', 'waiting')"  # what holds an idempotency key
NOT_STARTED = ("queued", "retrying", "waiting")  # unfinished, not running: what a cancel or discard ends
# A job asked to cancel while it ran ends cancelled where it would run again (retry, release).
UNLESS_CANCELLED = ("state = CASE WHEN cancel_request IS NULL THEN {state} ELSE 'cancelled' END,"
                    f" finished_at = CASE WHEN cancel_request IS NULL THEN finished_at ELSE {NOW} END")


def stats_query(t, s):
    """``stats``: per queue (``%(q)s``), the ready, scheduled and per-state counts and the paused flag.

    Each arm is an index-only scan of a range of jobs_stats (queue, state, run_at) (schema
    version 6). NOW is written out in each arm, not joined from a CTE: the planner bounds the
    index range with a stable expression, and with the joined column it scanned the table.
    """
    return (
        f"SELECT queue, 'ready', count(*), max({NOW} - run_at) FROM {t}"
        "  WHERE queue = ANY(%(q)s::text[]) AND state IN ('queued', 'retrying')"
        f" AND run_at <= {NOW} GROUP BY queue"
        " UNION ALL"
        f" SELECT queue, 'scheduled', count(*), NULL FROM {t}"
        "  WHERE queue = ANY(%(q)s::text[]) AND state IN ('queued', 'retrying')"
        f" AND run_at > {NOW} GROUP BY queue"
        " UNION ALL"
        f" SELECT queue, state, count(*), NULL FROM {t}"
        "  WHERE queue = ANY(%(q)s::text[]) AND state IN ('running', 'dead', 'done', 'cancelled', 'expired',"
        " 'waiting')"
        "  GROUP BY queue, state"
        f" UNION ALL SELECT queue, 'paused', 1, NULL FROM {s}.paused_queues WHERE queue = ANY(%(q)s::text[])")


def leased_batch(t, rows, assignments, returning, edges=None):
    """An UPDATE of a batch of leased jobs: ``rows`` an ``unnest(...) AS b(id, token, ...)`` (its
    parameters come first), ``assignments`` the SET list (``j`` the job, ``l`` its row of the batch).

    The jobs are locked first, in id order, as every other write of several jobs locks
    them (cancel, requeue, discard). Left to the join, the update locked them in the
    order the plan met them (the batch's order, or an index's), and a batch holding B
    while it waited for A deadlocked a cancel holding A while it waited for B. The
    update then finds each job by id again (not by the locked row's ctid: a renewal
    committed while we waited moved the row, and the fence must read its new version).

    With ``edges`` (the quoted ``job_edges``: a write that ends the jobs, ``ack_many``), the
    children of the batch's workflow parents (``kids``) are locked next, all at once, in id
    order, before any row is updated. Each parent's end locks its children (``flow_settle``,
    schema version 11), one parent after another in the order the update met them: two
    batches ending parents of the same children crosswise (p_A then p_B, q_B then q_A)
    each held a child the other wanted, and PostgreSQL aborted one after deadlock_timeout.
    Locked here first, in one order, the children are the trigger's already. The lock is
    a one-time filter (an unreferenced CTE never runs), evaluated before the join reads a
    row; its ``ARRAY(...)`` reads the whole batch (every job locked) before any child is
    locked, and on a batch without ``kids`` it probes the edges' index with an empty array.
    (An edge an enqueue committed while the batch waited for its parent is not in the
    statement's snapshot: the trigger still locks that child, outside the order.)
    """
    lock, gate = "", ""
    if edges is not None:
        lock = (f", c AS MATERIALIZED (SELECT c.id FROM {t} c WHERE c.id IN (SELECT e.child FROM {edges} e"
                " WHERE e.parent = ANY(ARRAY(SELECT l.id FROM l WHERE l.kids)) AND NOT e.parent_gone)"
                " ORDER BY c.id FOR UPDATE OF c)")
        gate = " AND (SELECT count(*) FROM c) >= 0"
    return (f"WITH l AS MATERIALIZED (SELECT b.*{', j.kids' if edges is not None else ''} FROM {t} j, {rows}"
            f" WHERE j.id = b.id ORDER BY j.id FOR UPDATE OF j){lock}"
            f" UPDATE {t} j SET {assignments} FROM l"
            f" WHERE j.id = l.id AND j.token = l.token AND j.state = 'running'{gate}"
            f" RETURNING {returning}")


class Statements:
    def __init__(self, s):
        """``s``: the quoted schema."""
        t = f"{s}.jobs"
        self.enqueue = (
            f"INSERT INTO {t} (id, queue, type, payload, state, resource_id, idempotency_key,"
            " max_attempts, timeout, priority, run_at, queued_at, trace_id, expires_at, token)"
            " SELECT i.id, i.queue, i.type, i.payload::json, 'queued', i.resource_id, i.idempotency_key,"
            "  i.max_attempts, i.timeout, i.priority, n.now + i.delay, n.now, i.trace_id, n.now + i.expires_in,"
            f"  {FIRST_TOKEN}"
            " FROM unnest(%b::text[], %b::text[], %b::text[], %b::text[], %b::text[], %b::text[],"
            "  %b::integer[], %b::float8[], %b::integer[], %b::float8[], %b::text[], %b::float8[], %b::bigint[])"
            "  WITH ORDINALITY"
            "  AS i(id, queue, type, payload, resource_id, idempotency_key, max_attempts, timeout, priority,"
            "  delay, trace_id, expires_in, token, ord),"
            f" (SELECT {NOW} AS now) n"
            " ORDER BY i.ord"
            " ON CONFLICT DO NOTHING"
            " RETURNING id, CASE WHEN run_at <= queued_at THEN pg_notify(%s, queue) END"
        )
        self.existing = (
            f"SELECT id, idempotency_key, state, queue FROM {t}"
            f" WHERE (idempotency_key = ANY(%s::text[]) AND state IN {UNFINISHED}) OR id = ANY(%s::text[])"
        )
        self.queues_of = f"SELECT id, queue FROM {t} WHERE id = ANY(%s::text[])"
        self.claim = f"SELECT * FROM {s}.claim(%s::text[], %s::integer, %s::float8, %s::text)"
        self.extend = leased_batch(t, "unnest(%b::text[], %b::bigint[]) AS b(id, token)",
                                   f"lease_until = {NOW} + %s::float8", "j.id, j.token")
        close = "history = jsonb_set(history, '{-1}', (history -> -1) || %(info)s::jsonb || jsonb_build_object("
        leased = "WHERE id = %(id)s AND token = %(token)s AND state = 'running'"
        retrying, queued = UNLESS_CANCELLED.format(state="'retrying'"), UNLESS_CANCELLED.format(state="'queued'")
        self.ack = (
            f"UPDATE {t} SET state = 'done', result = %(result)s::json, finished_at = {NOW}, lease_until = NULL, "
            + close + f"'ended_at', {NOW}, 'outcome', 'done')) " + leased
        )
        self.ack_many = leased_batch(
            t, "unnest(%b::text[], %b::bigint[], %b::text[], %b::text[]) AS b(id, token, result, info)",
            f"state = 'done', result = l.result::json, finished_at = {NOW}, lease_until = NULL,"
            " history = jsonb_set(j.history, '{-1}', (j.history -> -1) || l.info::jsonb || jsonb_build_object("
            f"'ended_at', {NOW}, 'outcome', 'done'))", "j.id, j.token", edges=f"{s}.job_edges")
        self.retry = (
            f"UPDATE {t} SET {retrying}, run_at = %(run_at)s::float8,"
            " error = %(error)s::jsonb,"
            f" first_failure_at = coalesce(first_failure_at, {NOW}), last_failure_at = {NOW}, lease_until = NULL, "
            + close + f"'ended_at', {NOW}, 'outcome', 'retry', 'error', %(error)s::jsonb)) " + leased
            + f" RETURNING CASE WHEN run_at <= {NOW} THEN pg_notify(%(channel)s, queue) END"
        )
        self.dead = (
            f"UPDATE {t} SET state = 'dead', reason = %(reason)s, error = %(error)s::jsonb, finished_at = {NOW},"
            f" first_failure_at = coalesce(first_failure_at, {NOW}), last_failure_at = {NOW}, lease_until = NULL, "
            + close + f"'ended_at', {NOW}, 'outcome', 'dead', 'error', %(error)s::jsonb)) " + leased
        )
        # No attempt spent, nor a rate: the token goes back (the next claim's refill caps the bucket).
        self.release = (
            f"WITH r AS (UPDATE {t} SET {queued}, attempt = attempt - 1,"
            " lease_until = NULL, owner = NULL,"
            f" run_at = {NOW}, history = history - -1 " + leased + " RETURNING queue, type),"
            f" b AS (UPDATE {s}.rate_buckets SET tokens = tokens + 1 WHERE type IN (SELECT type FROM r))"
            " SELECT pg_notify(%(channel)s, queue) FROM r"
        )
