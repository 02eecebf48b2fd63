"""The mutation check: does the suite catch a broken guarantee?

``python -m tests.mutations`` copies the repository to a scratch folder and,
one at a time, breaks one guarantee with a small textual edit (an anchor that
must match exactly once: when the code moves, the check fails loudly instead of
testing nothing), then runs the tests written to catch it against the scratch
copy (``PYTHONPATH`` points there; the first run checks that ``supervisor`` is
imported from it, and the daemon subprocesses inherit it). A mutation that no
test fails is a guarantee without a test: the exit status is then 1.

Options: ``--list`` prints the mutations; ``--only NAME`` (repeatable) runs
those; ``--baseline`` first runs each selection without its mutation, which
must pass (a failure there means the catch would prove nothing).

Service tests need the Redis and PostgreSQL servers of ``tests/conftest.py``;
a skipped test is never counted as a catch (``TANGGUH_REQUIRE_SERVICES`` is
unset in the runs, so a missing server shows as a survivor, not as a failure).
"""
import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFORMANCE = "tests/test_broker_conformance.py"
CONTROL = "tests/test_conformance_control.py"
NOT_FENCED = "WHERE id = :id AND state = 'running'"  # the SQLite fence without its token


@dataclasses.dataclass
class Mutation:
    name: str
    path: str  # relative to the repository
    old: str  # must occur exactly once in the file
    new: str
    tests: tuple  # pytest arguments (files, -k)
    breaks: str  # the guarantee it breaks


# The limited PostgreSQL claim's wait for the limit's lock, and its read of the paused queues.
PG_LIMIT_LOCK = (
    '            db.execute("SELECT count(pg_advisory_xact_lock(hashtextextended(%s || l.t, 0)))"\n'
    '                       " FROM (SELECT t FROM unnest(%s::text[]) AS t ORDER BY t) l",\n'
    '                       (f"tangguh-limit:{self.schema}:", types))\n')
PG_UNPAUSED = (
    "            # After the wait for the lock: a pause that committed meanwhile holds for this claim.\n"
    "            queues = self._unpaused(db, queues)\n")

MUTATIONS = [
    # The four the suite used to miss.
    Mutation("sqlite-ack-many-fencing", "supervisor/backends/sqlite/__init__.py",
             'f" {_CLOSE_ENTRY} WHERE {_LEASED}",', f'f" {{_CLOSE_ENTRY}} {NOT_FENCED}",',
             (CONFORMANCE, "-k", "sqlite and (stale or ack_many)"), "ack_many refuses a stale lease (SQLite)"),
    Mutation("redis-ack-many-fencing", "supervisor/backends/redis_lua/ack_many.lua",
             "  if v[1] == 'running' and v[2] == token then", "  if v[1] == 'running' then",
             (CONFORMANCE, "-k", "redis and (stale or ack_many)"), "ack_many refuses a stale lease (Redis)"),
    Mutation("postgres-ack-many-fencing", "supervisor/backends/postgres/statements.py",
             '" WHERE j.id = l.id AND j.token = l.token AND j.state = \'running\'"',
             '" WHERE j.id = l.id AND j.state = \'running\'"',
             (CONFORMANCE, "-k", "postgres and (stale or ack_many)"), "ack_many refuses a stale lease (PostgreSQL)"),
    Mutation("lease-renewal-off", "supervisor/heartbeat.py",
             "br.renew(leases, self.lease_seconds, progress)",
             # Still finds lost leases, never extends one.
             "Renewal([x for x in leases if (lambda j: j is None or (j.state, j.token) != ('running', x.token))"
             "(br.get(x.job_id))])",
             ("tests/test_leases.py", "-k", "sqlite"), "the heartbeat renews the leases of running jobs"),
    Mutation("next-delay-no-jitter", "supervisor/retry.py",
             "return delay * (1.0 - float(jitter) * rng())", "return delay",
             ("tests/test_retry.py",), "retry delays are spread by jitter"),
    Mutation("sqlite-claim-no-priority", "supervisor/backends/sqlite/ready.py",
             'priority = db.execute(f"SELECT max(priority) {_WAITING}"', 'priority = db.execute(f"SELECT min(priority) {_WAITING}"',
             (CONFORMANCE, "-k", "sqlite and priorit"), "the broker claims the highest priorities first"),
    # The ones the suite caught already: kept so that it goes on catching them.
    Mutation("redis-ack-fencing", "supervisor/backends/redis_lua/ack.lua",
             "if not is_leased(key, token) then return 0 end",
             "if redis.call('HGET', key, 'state') ~= 'running' then return 0 end",
             (CONFORMANCE, "-k", "redis and (stale or reclaimed)"), "ack refuses a stale lease"),
    Mutation("redis-retry-fencing", "supervisor/backends/redis_lua/retry.lua",
             "if not is_leased(key, token) then return 0 end",
             "if redis.call('HGET', key, 'state') ~= 'running' then return 0 end",
             (CONFORMANCE, "-k", "redis and (stale or reclaimed)"), "retry refuses a stale lease"),
    Mutation("redis-dead-fencing", "supervisor/backends/redis_lua/dead.lua",
             "if not is_leased(key, token) then return 0 end",
             "if redis.call('HGET', key, 'state') ~= 'running' then return 0 end",
             (CONFORMANCE, "-k", "redis and (stale or reclaimed)"), "dead refuses a stale lease"),
    Mutation("sqlite-release-fencing", "supervisor/backends/sqlite/__init__.py",
             "history = json_remove(history, '$[#-1]') WHERE \" + _LEASED,",
             f"history = json_remove(history, '$[#-1]') {NOT_FENCED}\",",
             (CONFORMANCE, "-k", "sqlite and (stale or reclaimed)"), "release refuses a stale lease"),
    Mutation("postgres-single-write-fencing", "supervisor/backends/postgres/statements.py",
             "leased = \"WHERE id = %(id)s AND token = %(token)s AND state = 'running'\"",
             "leased = \"WHERE id = %(id)s AND state = 'running'\"",
             (CONFORMANCE, "-k", "postgres and (stale or reclaimed)"), "ack/retry/dead/release refuse a stale lease"),
    Mutation("lease-reclaim-off", "supervisor/backends/sqlite/control.py",
             "\" AND lease_until < ?\", (now,)",
             "\" AND lease_until < ? AND 0\", (now,)",
             (CONFORMANCE, "-k", "sqlite and reclaimed"), "an expired lease is reclaimed"),
    Mutation("dead-letter-off", "supervisor/master/verdict.py",
             "if kind in DEAD_AT_ONCE or attempt >= max_attempts:",
             "if kind in DEAD_AT_ONCE:",
             ("tests/test_daemon.py", "-k", "poison"), "a job out of attempts is dead-lettered"),
    Mutation("crash-not-rerun", "supervisor/master/verdict.py",
             'return failure(attempt, max_attempts, CRASHED, "WorkerCrashed", f"child died mid-job ({ending.exit_how})", backoff)',
             "return Outcome(ACK)",
             ("tests/test_daemon.py", "-k", "child_killed_mid_job"), "a job whose child died runs again"),
    Mutation("graceful-stop-kills", "supervisor/master/arbiter.py",
             'self.begin_stop("graceful")\n        self.stop_deadline = time.monotonic() + self.cfg.supervisor.graceful_timeout\n'
             "        self.pool.retire_all()",
             'self.begin_stop("graceful")\n        self.stop_deadline = time.monotonic() + self.cfg.supervisor.graceful_timeout\n'
             "        self.pool.kill_all(KILLED_SHUTDOWN)",
             ("tests/test_daemon.py", "-k", "sigterm_lets"), "SIGTERM lets running jobs finish"),
    Mutation("hard-timeout-off", "supervisor/master/overdue.py",
             "if c.job is None or c.deadline is None or now < c.deadline:", "if True:",
             ("tests/test_daemon.py", "-k", "hard_timeout"), "a job over its hard timeout is killed"),
    Mutation("idempotency-off", "supervisor/toolkit/idempotency.py",
             'elif row["status"] == "done":', "elif False:",
             ("tests/test_toolkit.py", "-k", "idempotency_on_sqlite"), "a done idempotency key suppresses the effect"),
    # Job control (issue 15).
    Mutation("cancel-verdict-off", "supervisor/master/verdict.py",
             "    if ending.cancel_sent and not (", "    if False and ending.cancel_sent and not (",
             ("tests/test_verdict.py",), "a job cancelled while it ran ends cancelled, not retried"),
    Mutation("cancel-inside-critical", "supervisor/child/timeouts.py",
             "    if _depth > 0:\n        _pending = _pending or exc", "    if False:\n        _pending = _pending or exc",
             ("tests/test_job_control.py", "-k", "bell"), "Cancelled is never raised inside critical()"),
    Mutation("cancel-grace-no-kill", "supervisor/master/overdue.py",
             "c.cancel_deadline is not None and now >= c.cancel_deadline:",
             "c.cancel_deadline is not None and now >= c.cancel_deadline and False:",
             ("tests/test_job_control.py", "-k", "sqlite and cancel_stuck"), "a handler past cancel_grace is killed"),
    Mutation("pause-keeps-prefetched", "supervisor/master/control.py",
             "released = self.dispatcher.take_queues(newly)", "released = []",
             ("tests/test_job_control.py", "-k", "sqlite and pause"), "a pause releases the prefetched jobs"),
    Mutation("backoff-flat", "supervisor/retry.py",
             "float(base) * (2.0 ** min(tries - 1, MAX_EXPONENT))", "float(base)",
             ("tests/test_retry.py", "tests/test_daemon.py", "-k", "delay or poison"),
             "retry delays grow with the attempt"),
    # Job control (tests/test_conformance_control.py).
    Mutation("cancel-without-row-locks", "supervisor/backends/postgres/control.py",
             '" FOR UPDATE", (job_ids,)).fetchall())', '"", (job_ids,)).fetchall())',
             (CONTROL, "-k", "postgres and racing_four"), "a job cancelled while queued is never started"),
    Mutation("pause-ignored", "supervisor/backends/sqlite/control.py",
             "return [q for q in queues if q not in paused]", "return list(queues)",
             (CONTROL, "-k", "sqlite and pause_stops"), "no claimer leases from a paused queue"),
    Mutation("redis-cancel-leaves-ready", "supervisor/backends/redis_lua/cancel.lua",
             "    unqueue(id, f[2])\n", "\n",
             (CONTROL, "-k", "redis and cancel_ends"), "a cancelled job leaves the ready queue"),
    # Both ways a claim ends a job past its expiry (expire_due's sweep, and a popped job's check) go
    # through end_expired: turned off, such a job stays queued and runs.
    Mutation("redis-expiry-off", "supervisor/backends/redis_lua/_control.lua",
             "  redis.call('HSET', key, 'state', 'expired', 'finished_at', secs(NOW))\n",
             "  do return end\n",
             (CONTROL, "-k", "redis and due_past"), "a job due past its expiry ends expired, never runs"),
    Mutation("wait-not-notified", "supervisor/backends/postgres/control_schema.py",
             "WHEN (NEW.waited AND", "WHEN (false AND",
             (CONTROL, "-k", "postgres and woken"), "wait is woken by the broker's notification"),
    # The web console's safety (issue 16).
    Mutation("web-csrf-off", "supervisor/web/csrf.py",
             "return bool(expected and isinstance(sent, str) and hmac.compare_digest(sent, expected))", "return True",
             ("tests/test_web.py", "-k", "sqlite and csrf"), "a console action without the CSRF token is refused"),
    Mutation("web-viewer-acts", "supervisor/web/console.py", "if not identity.admin:", "if False:",
             ("tests/test_web.py", "-k", "sqlite and viewer"), "a viewer's POST is refused"),
    Mutation("web-redaction-off", "supervisor/web/redact.py", "        if not self.fields:\n", "        if True:\n",
             ("tests/test_web.py", "-k", "sqlite and redacted"), "redacted fields never reach a page or the API"),
    Mutation("web-open-on-any-address", "supervisor/web/auth.py",
             "if not is_loopback(host) and not auth_configured(web):", "if False:",
             ("tests/test_web.py", "-k", "loopback"), "no console on a non-loopback address without users"),
    Mutation("sqlite-locked-at-start-exits", "supervisor/master/arbiter.py",
             'if self.cfg.broker.url.startswith("sqlite:") and not isinstance(cause, BrokerBusy):',
             'if self.cfg.broker.url.startswith("sqlite:"):',
             ("tests/test_outages.py", "-k", "locked_at_start"), "a SQLite file locked at start is waited out"),
    Mutation("login-throttle-off", "supervisor/web/throttle.py",
             "if times is None or len(times) < self.failures:", "if True:",
             ("tests/test_web.py", "-k", "throttled"), "failed logins from one address are throttled"),
    Mutation("top-up-behind-a-long-job", "supervisor/master/dispatch.py",
             "and not self.prefetch.long(now - c.started)", "and True",
             ("tests/test_batches.py", "-k", "runs_long"), "nothing is queued behind a job that runs long"),
    Mutation("postgres-batch-lock-order", "supervisor/backends/postgres/statements.py",
             "WHERE j.id = b.id ORDER BY j.id FOR UPDATE OF j)", "WHERE j.id = b.id)",
             ("tests/test_postgres_broker.py", "-k", "id_order"),
             "a batch of acks, extends or renewals never deadlocks a cancel (PostgreSQL)"),
    Mutation("postgres-deadlock-victim-statement", "supervisor/backends/postgres/connection.py",
             "if not retries_left or db.info.transaction_status != TransactionStatus.IDLE:", "if True:",
             ("tests/test_postgres_broker.py", "-k", "aborts_to_break and ack"),
             "a statement PostgreSQL aborted to break a deadlock runs again"),
    Mutation("postgres-deadlock-victim-transaction", "supervisor/backends/postgres/connection.py",
             "if (not retries_left or kwargs.get", "if (True or kwargs.get",
             ("tests/test_postgres_broker.py", "-k", "aborts_to_break and cancel"),
             "a transaction PostgreSQL aborted to break a deadlock runs again"),
    Mutation("postgres-reopen-unlocked", "supervisor/backends/postgres/workflows.py",
             "                ORDER BY child, parent FOR UPDATE;", "                ORDER BY child, parent;",
             ("tests/test_postgres_broker.py", "-k", "reopened_while"),
             "a reopened workflow child counts a parent ending at the same moment (PostgreSQL)"),
    Mutation("child-one-frame-per-job", "supervisor/child/worker.py",
             "handed back what a SKIP names.\n                continue\n", "handed back what a SKIP names.\n",
             ("tests/test_batches.py", "-k", "topped_up"),
             "a job handed back behind a topped-up child never starts there"),
    Mutation("retiring-child-keeps-its-batch", "supervisor/master/arbiter.py",
             "            if c.retiring and c.queued:", "            if False:",
             ("tests/test_batches.py", "-k", "reload_takes_back"),
             "a reload hands back the batch queued behind an old child's running job"),
    Mutation("sqlite-renew-clock-before-lock", "supervisor/backends/sqlite/control.py",
             "        with self._write():\n            now = self.now()  # once the write lock is ours",
             "        now = self.now()\n        with self._write():\n            pass  # once the write lock is ours",
             ("tests/test_sqlite_broker.py", "-k", "wait_for_the_write_lock and renew"),
             "a renewal that waited for SQLite's write lock still grants a whole lease"),
    Mutation("redis-claim-drops-leased-on-failure", "supervisor/backends/redis/__init__.py",
             "                if not claimed:\n                    raise\n",
             "                raise\n",
             ("tests/test_redis_broker.py", "-k", "later_queues"),
             "a claim whose later queue fails keeps the jobs it leased before"),
    Mutation("redis-claim-keeps-expiry-entry", "supervisor/backends/redis_lua/claim.lua",
             "    if f[4] then redis.call('ZREM', EXPIRING, id) end",
             "",
             ("tests/test_redis_broker.py", "-k", "expiry_index and plain"),
             "a claimed job leaves the expiry index (no entry per finished job)"),
    Mutation("pause-leaves-child-batch", "supervisor/master/control.py",
             "                self.withdraw(c)  # behind its running job, not started: handed back with the rest of the batch",
             "                pass",
             ("tests/test_batches.py", "-k", "pause_hands_back and sqlite"),
             "a pause hands back its queue's jobs queued in a child's batch"),
    Mutation("top-up-over-the-pipe", "supervisor/master/pool.py",
             "        while c.job is not None and len(frame) > c.room and batch:",
             "        while False:",
             ("tests/test_batches.py", "-k", "larger_than_the_pipe"),
             "a top-up to a busy child fits in its pipe: the master never blocks sending it"),
    Mutation("postgres-chosen-id-checked-late", "supervisor/backends/postgres/__init__.py",
             "        if chosen:  # refused before anything is stored", "        if False:",
             (CONFORMANCE, "-k", "postgres and caller_chose"),
             "an id the caller chose, taken in another queue, is refused before any job of the batch is stored"),
    Mutation("sqlite-chosen-id-resend", "supervisor/backends/sqlite/producing.py",
             "                if job.id in taken:", "                if False:",
             (CONFORMANCE, "-k", "sqlite and caller_chose"),
             "a resend of a job whose id the caller chose returns it (SQLite)"),
    Mutation("payload-nul-stored", "supervisor/jsonvalues.py",
             '    if ("\\\\u0000" in text or "\\\\ud" in text) and _holds_unstorable(value):', "    if False:",
             (CONFORMANCE, "-k", "rejects_bad_fields and payload"),
             "a payload no database stores (NUL, a lone surrogate) is BadInput on every broker"),
    Mutation("postgres-migrate-asks-create", "supervisor/backends/postgres/schema.py",
             "        _adopt(db, schema, tables)\n", "        _adopt(db, schema, tables)\n    if True:\n",
             ("tests/test_postgres_broker.py", "-k", "without_create"),
             "an up-to-date PostgreSQL schema migrates as a role without the CREATE privilege"),
    Mutation("release-keeps-rate-token", "supervisor/backends/sqlite/__init__.py",
             'self.db.execute("UPDATE rate_buckets SET tokens = tokens + 1', 'self.db.execute("UPDATE rate_buckets SET tokens = tokens',
             (CONFORMANCE, "-k", "sqlite and gives_its_rate_token"),
             "a released lease gives its rate-limit token back (SQLite)"),
    Mutation("sqlite-prune-one-transaction", "supervisor/backends/sqlite/__init__.py",
             "WHERE state IN\"\n                                        f\" ({states}) AND finished_at < ? AND NOT ({keep})"
             " LIMIT {PRUNE_BATCH})\",",
             "WHERE state IN\"\n                                        f\" ({states}) AND finished_at < ? AND NOT ({keep})"
             " LIMIT -1)\",",
             ("tests/test_sqlite_broker.py", "-k", "backlog"),
             "SQLite prunes a backlog in short write transactions"),
    Mutation("heartbeat-restart-waits-an-interval", "supervisor/heartbeat.py",
             "        if self.due is None:\n", "        if True:\n",
             ("tests/test_leases.py", "-k", "forked_faster"),
             "leases are renewed while children are forked faster than the heartbeat beats"),
    Mutation("cron-that-never-matches", "supervisor/checks.py",
             "            croniter.croniter(v).get_next()", "            pass",
             ("tests/test_config.py", "-k", "bad_values"), "a cron expression that matches no date is a config error"),
    Mutation("reload-overflows", "supervisor/checks.py",
             "    except OverflowError:  # an integer too large", "    except ZeroDivisionError:  # an integer too large",
             ("tests/test_daemon.py", "-k", "sighup_with_a_broken and huge_number"),
             "a reload with a number too large for a float keeps the master serving"),
    Mutation("registry-trips-on-a-proxy", "supervisor/registry.py",
             "            except Exception:  # noqa: BLE001 - a lazy proxy", "            except ZeroDivisionError:  # a lazy proxy",
             ("tests/test_jobref.py", "-k", "lazy_proxy"), "a handler file may hold a lazy proxy global"),
    Mutation("reload-applies-a-new-socket", "supervisor/master/arbiter.py",
             '("supervisor", "socket"), ("supervisor", "socket_mode"),', '("supervisor", "socket_mode"),',
             ("tests/test_daemon.py", "-k", "sighup_with_a_broken and socket"),
             "a reload that changes the control socket is refused"),
    Mutation("retry-later-any-delay", "supervisor/master/verdict.py",
             "    delay = _seconds(delay)\n", "\n",
             ("tests/test_verdict.py", "-k", "RetryLater"), "a RetryLater delay that is no number of seconds gets the backoff"),
    Mutation("reload-keeps-old-modules", "supervisor/master/arbiter.py",
             "        registry.forget_generation(self.generation - 1)  # once nothing here holds its handlers\n", "",
             ("tests/test_daemon.py", "-k", "lets_go"), "a reload lets go of the previous generation's handler modules"),
    Mutation("cache-fill-lease-unknown-to-master", "supervisor/child/context.py",
             "self.metrics, notify=toolkit.notify_master)", "self.metrics)",
             ("tests/test_effects.py", "-k", "fill_lease"), "a dead builder's cache fill lease is freed at once"),
    Mutation("postgres-claim-expires-a-whole-backlog", "supervisor/backends/postgres/control_schema.py",
             "LIMIT {EXPIRE_BATCH} FOR UPDATE SKIP LOCKED) x", "FOR UPDATE SKIP LOCKED) x",
             ("tests/test_postgres_broker.py", "-k", "bounded_number_of_expired"),
             "one PostgreSQL claim ends a bounded number of expired jobs"),
    Mutation("heartbeat-hides-retaken-lease", "supervisor/heartbeat.py",
             "                self.lost.append(old)\n", "                pass\n",
             ("tests/test_leases.py", "-k", "own_claim"),
             "our own claim retaking a job kills the attempt still running under the old lease"),
    Mutation("heartbeat-drop-by-job-id", "supervisor/heartbeat.py",
             "            if self.held.get(lease.job_id) == lease:\n                del self.held[lease.job_id]\n",
             "            self.held.pop(lease.job_id, None)\n",
             ("tests/test_leases.py", "-k", "new_lease"),
             "storing an old attempt's outcome leaves the new attempt's lease renewed"),
    Mutation("redis-chosen-id-across-queues", "supervisor/backends/redis/__init__.py",
             "            if queue != chosen[job_id]:", "            if False:",
             ("tests/test_redis_broker.py", "-k", "caller_chose"),
             "an id the caller chose may not name a job of another queue"),
    Mutation("web-open-console-any-host", "supervisor/web/app.py",
             "*([] if auth.auth_configured(cfg.web) else [Middleware(LoopbackHostsOnly)]),", "",
             ("tests/test_web.py", "-k", "rebound and sqlite"),
             "an open console answers requests to a loopback host only (DNS rebinding)"),
    Mutation("web-parents-unredacted", "supervisor/web/redact.py",
             "        if d.get(\"parents\"):", "        if False:",
             ("tests/test_web.py", "-k", "parents_result and sqlite"),
             "a redacted field of a parent's result is masked in a child's API answer"),
    Mutation("web-500-without-headers", "supervisor/web/app.py",
             "    response.headers.update({name.decode(): value.decode() for name, value in HEADERS})\n", "",
             ("tests/test_web.py", "-k", "unexpected_error"),
             "an internal-error answer carries the security headers"),
    Mutation("web-logout-keeps-session", "supervisor/web/pages.py",
             "        console_of(request).sessions.end(request.session.get(\"sid\"))", "        pass",
             ("tests/test_web.py", "-k", "logout_ends and sqlite"),
             "a logout ends the session for a copy of its cookie too"),
    Mutation("web-argon2-on-the-loop", "supervisor/web/console.py",
             "        return await asyncio.get_running_loop().run_in_executor(self.hashing, auth.check_password, self.web, name,\n"
             "                                                                password)",
             "        return auth.check_password(self.web, name, password)",
             ("tests/test_web.py", "-k", "never_holds_up and sqlite"),
             "a password check never holds up the console's other requests"),
    # The handler toolkit (review of the toolkit and the application-side API).
    Mutation("sqlite-failed-begin-stays-busy", "supervisor/toolkit/transaction.py",
             "            self.db.busy = False\n            if kind == \"sqlite\" and conn.in_transaction",
             "            pass\n            if kind == \"sqlite\" and conn.in_transaction",
             ("tests/test_toolkit.py", "-k", "begin_that_fails"),
             "a BEGIN that failed leaves ctx.transaction() usable in that process"),
    Mutation("cache-lease-kept-when-value-unstorable", "supervisor/toolkit/cache.py",
             "            entry, ms = self._entry(key, builder(), ttl, stale_ttl)\n        except BaseException:",
             "            value = builder()\n        except BaseException:\n            raise\n"
             "        entry, ms = self._entry(key, value, ttl, stale_ttl)\n        try:\n            pass\n"
             "        except BaseException:",
             ("tests/test_toolkit.py", "-k", "json_cannot"),
             "a cache value that cannot be stored frees its fill lease at once"),
    Mutation("cache-store-error-unhandled", "supervisor/toolkit/cache.py",
             "        except (redis_py.ConnectionError, redis_py.TimeoutError) as exc:\n            # The value is built",
             "        except ZeroDivisionError as exc:\n            # The value is built",
             ("tests/test_toolkit.py", "-k", "after_the_build"),
             "Redis failing after the builder ran returns the value, built once"),
    Mutation("idempotency-prune-in-job-transaction", "supervisor/toolkit/idempotency.py",
             "tx.after_commit(lambda: _prune_alone(tx.conn, tx.kind, self.retention))", "prune(tx, self.retention)",
             ("tests/test_toolkit.py", "-k", "pruning_waits"),
             "idempotency pruning runs outside the job's transaction"),
    Mutation("idempotency-prune-waits-on-locks", "supervisor/toolkit/idempotency.py",
             'pick += " FOR UPDATE SKIP LOCKED"', 'pick += ""',
             ("tests/test_toolkit.py", "-k", "prune_skips"),
             "idempotency pruning never waits on records another transaction holds"),
    # Operations review (huge error text, the control socket, reloads, reused job ids).
    Mutation("child-error-message-uncut", "supervisor/child/worker.py",
             "    message = clip_start(full, MAX_ERROR_MESSAGE)\n", "    message = full\n",
             ("tests/test_master_robustness.py", "-k", "huge_exception"),
             "a handler's huge exception message is cut in the child, before the pipe and the logs"),
    Mutation("error-info-uncut", "supervisor/model.py",
             '"message": storable(clip_start(message, MAX_ERROR_MESSAGE)),', '"message": storable(message),',
             ("tests/test_master_robustness.py", "-k", "error_info_cuts"),
             "error text reaching a broker by any path is cut to its limit"),
    Mutation("health-connect-fails-on-full-queue", "supervisor/health.py",
             "            s.connect(path)\n", "            s.settimeout(timeout)\n            s.connect(path)\n",
             ("tests/test_master_robustness.py", "-k", "flood"),
             "the CLI's connect waits for room in a full accept queue"),
    Mutation("oneshot-accepts-without-end-unread", "supervisor/oneshot.py",
             "        for _ in range(self.accept_batch):\n            try:\n                conn, _ = self.listener.accept()\n"
             "            except OSError:  # BlockingIOError: none left; anything else: try on the next wake-up\n"
             "                return\n            conn.setblocking(False)\n"
             "            client = _Client(conn, time.monotonic() + min(IDLE_SECONDS, self.client_timeout))\n"
             "            self.clients[client.fd] = client\n"
             "            self.selector.register(conn, selectors.EVENT_READ, lambda mask, c=client: self._io(c, mask))\n"
             "            self._io(client, selectors.EVENT_READ)",
             # Both halves: either one alone keeps the operator's connection from being pushed out unread.
             "        while True:\n            try:\n                conn, _ = self.listener.accept()\n"
             "            except OSError:\n                return\n            conn.setblocking(False)\n"
             "            client = _Client(conn, time.monotonic() + min(IDLE_SECONDS, self.client_timeout))\n"
             "            self.clients[client.fd] = client\n"
             "            self.selector.register(conn, selectors.EVENT_READ, lambda mask, c=client: self._io(c, mask))\n"
             "            pass",
             ("tests/test_master_robustness.py", "-k", "flood"),
             "a flood of silent connections cannot push out a client before its request is read"),
    Mutation("dropped-queue-gauges-kept", "supervisor/metrics.py",
             "        self.sampled_queues = set(stats)\n", "        self.sampled_queues = set()\n",
             ("tests/test_metrics.py", "-k", "reload_stops"),
             "a queue a reload stops serving loses its queue gauges"),
    Mutation("chosen-id-token-restarts-at-zero", "supervisor/model.py",
             'return 0 if job.__dict__.get("_id_made") else int(time.time() * 1000) << 10', "return 0",
             (CONFORMANCE, "-k", "reused_job_id"),
             "a reused job id's new job never meets a lease of the deleted one (every broker)"),
    Mutation("postgres-flow-token-at-zero", "supervisor/backends/postgres/workflows.py",
             "pending, level or None, j.id in parents, tokens[j.id])", "pending, level or None, j.id in parents, 0)",
             (CONFORMANCE, "-k", "postgres and reused_job_id and flow"),
             "a workflow job with a reused id starts from a fresh token (PostgreSQL)"),
    Mutation("redis-enqueue-token-at-zero", "supervisor/backends/redis/fields.py",
             '"token", str(first_token(job))]', '"token", "0"]',
             (CONFORMANCE, "-k", "redis and reused_job_id"),
             "a job with a reused id starts from a fresh token (Redis)"),
    Mutation("oneshot-new-connection-unread", "supervisor/oneshot.py",
             "            self._io(client, selectors.EVENT_READ)  # usually the whole request is here: answered now\n",
             "            pass\n",
             ("tests/test_master_robustness.py", "-k", "oldest_silent"),
             "a request there when its connection is accepted is answered without pushing a client out"),
    Mutation("postgres-limited-claim-reads-pauses-early", "supervisor/backends/postgres/__init__.py",
             PG_LIMIT_LOCK + PG_UNPAUSED, PG_UNPAUSED + PG_LIMIT_LOCK,
             ("tests/test_postgres_broker.py", "-k", "paused_meanwhile"),
             "a limited PostgreSQL claim that waited for the limit's lock skips a queue paused meanwhile"),
    Mutation("spawn-failure-ends-master", "supervisor/master/pool.py",
             "        except OSError as exc:\n            # Out of descriptors",
             "        except ValueError as exc:\n            # Out of descriptors",
             ("tests/test_daemon.py", "-k", "forks_the_system_refuses"),
             "a fork the system refuses leaves the master serving with the children it has"),
    Mutation("no-descriptor-reserve", "supervisor/childlimits.py",
             "    if used + reserve > soft:", "    if used > soft:",
             ("tests/test_daemon.py", "-k", "forks_the_system_refuses"),
             "the master keeps descriptors for the socket and the broker when forking"),
    Mutation("paused-gauge-only-on-change", "supervisor/metrics.py",
             "            self.queue_paused.labels(queue).set(1 if s.paused else 0)\n", "",
             ("tests/test_metrics.py", "-k", "reload_stops_serving"),
             "a queue a reload serves again shows its paused flag"),
    Mutation("web-cookie-never-secure", "supervisor/web/headers.py",
             "[secure(h) if https else h for h in", "[h for h in",
             ("tests/test_web.py", "-k", "https"),
             "over HTTPS the console's session cookie carries Secure"),
    Mutation("redis-claim-leases-past-expiry", "supervisor/backends/redis_lua/claim.lua",
             "  if (f[1] == 'queued' or f[1] == 'retrying') and past_expiry(f[4]) then", "  if false then",
             (CONTROL, "-k", "redis and backlog_of_expired and plain"),
             "a claim never leases a job past its expiry that its expire_due batch left (Redis)"),
    Mutation("redis-limited-claim-leases-past-expiry", "supervisor/backends/redis_lua/claim_limited.lua",
             "    elseif past_expiry(f[3]) and (f[4] == 'queued' or f[4] == 'retrying') then", "    elseif false then",
             (CONTROL, "-k", "redis and backlog_of_expired and limited"),
             "a limited claim never leases a job past its expiry that expire_due left (Redis)"),
    Mutation("postgres-limited-claim-leases-past-expiry", "supervisor/backends/postgres/ready.py",
             '"AND (d.expires_at IS NULL OR d.expires_at > %s)"', '"AND (d.expires_at IS NULL OR %s IS NOT NULL)"',
             (CONTROL, "-k", "postgres and backlog_of_expired and limited"),
             "a limited claim never leases a job past its expiry that the claim function left (PostgreSQL)"),
    Mutation("redis-deleted-child-keeps-edges", "supervisor/backends/redis_lua/_flows.lua",
             "  if redis.call('HEXISTS', key, 'pending') == 0 then return end", "  do return end",
             ("tests/test_conformance_workflows.py", "-k", "redis and leaves_no_edge"),
             "a deleted child's parents never settle or reopen a new job of its id (Redis)"),
    # The toolkit's Redis keys: fences that survive a lost counter, counters and tags that stay bounded.
    Mutation("lock-fence-not-seeded-from-clock", "supervisor/toolkit/locks.py",
             "if (tonumber(redis.call('GET', KEYS[2])) or 0) < floor then", "if false then",
             ("tests/test_toolkit.py", "-k", "rewinds_the_counter"),
             "a lock's fence stays above every earlier one after Redis lost or rewound its counter"),
    Mutation("lock-fence-counter-kept-forever", "supervisor/toolkit/locks.py",
             "redis.call('PEXPIRE', KEYS[2], ARGV[3])\n", "",
             ("tests/test_toolkit.py", "-k", "fence_counter_expires"),
             "an unused lock name's fence counter expires"),
    Mutation("cache-store-leaves-tags-to-expire", "supervisor/toolkit/cache.py",
             "  if redis.call('PTTL', KEYS[i]) < tonumber(ARGV[5]) then redis.call('PEXPIRE', KEYS[i], ARGV[5]) end\n",
             "", ("tests/test_toolkit.py", "-k", "outlives_its_tag"),
             "a cache entry's tags live as long as the entry, so invalidating a tag reaches it"),
    Mutation("cache-store-without-its-tag", "supervisor/toolkit/cache.py",
             "  if redis.call('SISMEMBER', KEYS[i], ARGV[4]) == 0 then", "  if false then",
             ("tests/test_toolkit.py", "-k", "outlives_its_tag"),
             "a build that outlived its tag stores nothing an invalidation could have missed"),
    Mutation("cache-tag-never-trimmed", "supervisor/toolkit/cache.py",
             "        redis.call('SREM', KEYS[i], key)\n", "",
             ("tests/test_toolkit.py", "-k", "only_members_that_may"),
             "a cache tag keeps only the members still readable or being filled"),
    Mutation("cache-big-tag-in-one-script", "supervisor/toolkit/cache.py",
             "  if redis.call('SCARD', tag) <= batch then", "  if true then",
             ("tests/test_toolkit.py", "-k", "big_tag"),
             "a big tag is invalidated in short scripts"),
    Mutation("redis-paused-reads-every-queue", "supervisor/backends/redis/control.py",
             "if queues is None else sorted(set(queues))", "if True else sorted(set(queues))",
             ("tests/test_redis_broker.py", "-k", "reads_no_other_queue"),
             "a heartbeat's paused() on Redis reads only the queues it serves"),
    Mutation("heartbeat-asks-every-pause", "supervisor/heartbeat.py",
             "br.paused(queues)", "br.paused()",
             ("tests/test_job_control.py", "-k", "pause_is_seen and sqlite"),
             "a supervisor's heartbeat asks the broker for the pauses of its own queues only"),
    Mutation("redis-renewer-keeps-every-entry", "supervisor/backends/redis/control.py",
             "        self._locator.renewing(lease.job_id for lease in leases)\n", "",
             ("tests/test_redis_broker.py", "-k", "only_for_the_leases_it_holds"),
             "the heartbeat's Redis instance keeps queue entries only for the leases it holds"),
    Mutation("redis-locator-wiped-at-bound", "supervisor/backends/redis/locate.py",
             "            for old in list(itertools.islice(self.known, WHERE_MAX // 4)):\n                del self.known[old]\n",
             "            self.known.clear()\n",
             ("tests/test_redis_broker.py", "-k", "only_for_the_leases_it_holds"),
             "the Redis job-queue cache is trimmed at its bound, never emptied"),
    Mutation("schedule-wait-uncapped", "supervisor/master/periodic.py",
             "min(CLOCK_CHECK_SECONDS, max(0.0, self.scheduler.due_at() - now))",
             "max(0.0, self.scheduler.due_at() - now)",
             ("tests/test_scheduling.py", "-k", "wall_clock_step"),
             "a wall-clock step forward is seen by the schedules within CLOCK_CHECK_SECONDS"),
    Mutation("prefetch-ignores-job-size", "supervisor/master/prefetch.py",
             "return count if not size else min(count, int(BYTES / size))", "return count",
             ("tests/test_prefetch.py", "-k", "large_jobs"),
             "at most BYTES of one type's jobs wait prefetched in the master"),
    Mutation("ready-waits-for-refused-forks", "supervisor/master/pool.py",
             "forked = self.missing() <= 0 or (self.spawn_failures > 0 and bool(self.live()))",
             "forked = self.missing() <= 0",
             ("tests/test_systemd.py", "-k", "lets_it_fork"),
             "READY goes to systemd with the children the system let the master fork"),
    Mutation("result-numbers-trusted", "supervisor/master/pool.py",
             "self.on_reply(c, protocol.clean_result(msg))", "self.on_reply(c, msg)",
             ("tests/test_master_robustness.py", "-k", "forged_result"),
             "a child's RESULT cannot end the master with numbers no float holds or texts that are not text"),
    Mutation("lock-ttl-through-float", "supervisor/master/locks.py",
             "            ttl = protocol.finite(msg.get(\"ttl\") or 0)", "            ttl = float(msg.get(\"ttl\") or 0)",
             ("tests/test_master_robustness.py", "-k", "forged_lock"),
             "a child's lock message cannot end the master with a TTL no float holds"),
    Mutation("fork-beside-threads-silent", "supervisor/childlimits.py",
             "    if others and not others <= seen:", "    if False:",
             ("tests/test_master_robustness.py", "-k", "thread_a_handler"),
             "the master names the threads a handler module started before it forks beside them"),
    Mutation("url-ambiguous-userinfo-accepted", "supervisor/urls.py",
             'if "@" in rest[len(parts.netloc):] or parts.netloc.count("@") > 1:', "if False:",
             ("tests/test_urls.py", "-k", "cannot_be_read"),
             "a server URL with an unencoded '@', '/', '?' or '#' in its password is refused without showing it"),
    Mutation("redact-trusts-the-first-netloc", "supervisor/urls.py",
             '        if "@" in rest[len(parts.netloc):]:\n', "        if False:\n",
             ("tests/test_urls.py", "-k", "cannot_be_read"),
             "redact never shows a password whose unencoded '#' or '?' ends the netloc early"),
    Mutation("config-not-utf8-internal-error", "supervisor/config.py",
             "    except UnicodeDecodeError as exc:", "    except ZeroDivisionError as exc:",
             ("tests/test_ops.py", "-k", "not_utf8"),
             "a config that is not UTF-8 is a config error (exit 2) naming the byte"),
    Mutation("config-check-asks-no-broker", "supervisor/cli/admin.py",
             "    check_broker(cfg.broker.url)\n", "",
             ("tests/test_config.py", "-k", "asks_the_broker"),
             "config check refuses the broker settings run would refuse"),
    Mutation("child-sends-any-count", "supervisor/child/worker.py",
             "            value = _number(value)\n",
             "            value = value if isinstance(value, int) else _number(value)\n",
             ("tests/test_hostile_input.py", "-k", "dropped_in_the_child"),
             "a count no float holds, or past int's text limit, is dropped in the child"),
    Mutation("forked-process-replies", "supervisor/child/worker.py",
             "        if _pid is not None and os.getpid() != _pid:\n            _leave_fork(exc)\n", "",
             ("tests/test_hostile_input.py", "-k", "forked"),
             "a process a handler forked never answers for the job"),
    Mutation("job-signals-persist", "supervisor/child/timeouts.py",
             "    if _installed_on == threading.get_ident():\n        _restore()\n", "",
             ("tests/test_hostile_input.py", "-k", "reset_before"),
             "a job's signal handlers and mask are undone before the next job"),
    Mutation("critical-shared-by-threads", "supervisor/child/timeouts.py",
             "    if threading.get_ident() != threading.main_thread().ident:", "    if False:",
             ("tests/test_hostile_input.py", "-k", "thread_a_job"),
             "only the main thread's critical() holds back a timeout or a cancel"),
    Mutation("child-str-failure-escapes", "supervisor/child/worker.py",
             "    except BaseException:  # noqa: BLE001 - any failure of a handler's __str__, SystemExit too",
             "    except Exception:  # noqa: BLE001 - any failure of a handler's __str__, SystemExit too",
             ("tests/test_hostile_input.py", "-k", "cannot_describe"),
             "an exception whose __str__ raises SystemExit is the handler's failure, not a crash"),
    Mutation("bulk-progress-held-back", "supervisor/cli/progress.py",
             "            self.done += 1  # counted before printing", "            pass  # counted before printing",
             ("tests/test_cli_partial.py", "-k", "fails_partway or goes_away"),
             "a bulk action stopped partway says how many it did: stopped after N of M, exit 1"),
    Mutation("closed-stdout-finishes-quietly", "supervisor/cli/progress.py",
             "            raise Failure(self.stopped(\"stdout closed\")) from None", "            raise",
             ("tests/test_cli_partial.py", "-k", "closed_stdout"),
             "a closed stdout stops a bulk action with a line saying how far it got; a listing ends quietly"),
    Mutation("dlq-replay-conflict-aborts", "supervisor/cli/dlq.py",
             "        if len(ids) == 1:\n            return {ids[0]: \"conflict\"}",
             "        raise",
             ("tests/test_cli_partial.py", "-k", "held_idempotency_key"),
             "dlq replay reports a held idempotency key per id and replays the other jobs"),
    Mutation("dlq-all-loaded-whole", "supervisor/cli/dlq.py",
             "        return pages(broker, f), count.n, count.exact",
             "        return iter([[j.id for j in broker.dlq_list(type=args.type, limit=None)]]), count.n, count.exact",
             ("tests/test_cli_partial.py", "-k", "page_by_page"),
             "dlq replay/purge --all select the dead jobs a page at a time, never all in memory"),
    Mutation("dry-run-json-as-text", "supervisor/cli/bulk.py",
             "            if args.json:\n                print_json({\"verb\": verb",
             "            if False:\n                print_json({\"verb\": verb",
             ("tests/test_cli_partial.py", "-k", "dry_run_json"),
             "--dry-run --json prints a JSON object"),
    Mutation("listing-closed-pipe-is-an-error", "supervisor/cli/__init__.py",
             "        stdout_gone()\n        return 141", "        raise OSError(32, 'Broken pipe')",
             ("tests/test_cli_partial.py", "-k", "closed_stdout"),
             "`tangguh jobs | head -1` ends quietly (141), no false error line"),
    Mutation("error-line-echoes-whole-argument", "supervisor/cli/__init__.py",
             "    if len(text) > ECHO_LIMIT:", "    if False:",
             ("tests/test_cli_partial.py", "-k", "hostile_arguments"),
             "an error line cuts a huge argument it quotes"),
    Mutation("child-obeys-a-handlers-alarm", "supervisor/child/timeouts.py",
             "    if _running and _armed:\n        _fire(JobTimeout", "    if _running:\n        _fire(JobTimeout",
             ("tests/test_hostile_input.py", "-k", "alarm_a_job_left"),
             "an alarm a handler left running is not a later job's soft timeout"),
    Mutation("child-sends-beside-threads", "supervisor/child/worker.py",
             "    with _send_lock:\n        sock.sendall(frame)", "    sock.sendall(frame)",
             ("tests/test_hostile_input.py", "-k", "tears_a_later"),
             "a thread a job left sending frames never tears a reply on the pipe"),
    Mutation("fork-backoff-ignores-exits", "supervisor/master/pool.py",
             "            if self.spawn_failures and c.state != STARTING:", "            if False:",
             ("tests/test_daemon.py", "-k", "forks_the_system_refuses"),
             "a child's exit frees what a refused fork lacked: the master forks again then"),
    Mutation("forked-import-runs-on", "supervisor/registry.py",
             "        if os.getpid() != pid:\n            # A process the module forked", "        if False:\n            # A process the module forked",
             ("tests/test_daemon.py", "-k", "forks_at_import"),
             "a process a handler module forks at import never runs on as a second master"),
    Mutation("sighup-at-start-ends-daemon", "supervisor/master/__init__.py",
             "        signal.signal(sig, lambda signum, _frame: held.append(signum))", "        pass",
             ("tests/test_daemon.py", "-k", "while_the_handlers_import"),
             "a SIGHUP during start-up is a reload afterwards, not the daemon's end"),
    Mutation("reload-error-unbounded", "supervisor/registry.py",
             "{clip_start(text, MAX_LOAD_ERROR)}", "{text}",
             ("tests/test_daemon.py", "-k", "broken_config_or_handler and huge_error"),
             "a handler file's huge exception is cut in status and the log"),
    Mutation("reload-accepts-empty-folder", "supervisor/registry.py",
             "    if current and not handlers:", "    if False:",
             ("tests/test_daemon.py", "-k", "broken_config_or_handler and empty"),
             "a reload finding no handler at all keeps the running generation"),
    Mutation("reload-keeps-handler-loggers", "supervisor/registry.py",
             "        loggers.pop(name, None)", "        pass",
             ("tests/test_daemon.py", "-k", "lets_go"),
             "a reload drops the old generation's loggers"),
    Mutation("first-generation-held-by-run", "supervisor/master/__init__.py",
             "    del handlers  # the arbiter's", "    pass  # the arbiter's",
             ("tests/test_daemon.py", "-k", "lets_go"),
             "generation 1's handler modules are freed by the first reload"),
    Mutation("reload-forgets-before-configure", "supervisor/master/arbiter.py",
             "        self.dispatcher.configure(cfg, handlers)\n        self.periodic.configure(cfg, handlers)\n"
             "        registry.forget_generation(self.generation - 1)",
             "        registry.forget_generation(self.generation - 1)\n        self.dispatcher.configure(cfg, handlers)\n"
             "        self.periodic.configure(cfg, handlers)",
             ("tests/test_daemon.py", "-k", "lets_go"),
             "a reload frees the old generation's modules at once, not at some later gc"),
    Mutation("child-dies-of-group-sighup", "supervisor/child/worker.py",
             "    signal.signal(signal.SIGHUP, _not_ours)", "    signal.signal(signal.SIGHUP, signal.SIG_DFL)",
             ("tests/test_daemon.py", "-k", "whole_group"),
             "a SIGHUP to the whole group reloads without ending running jobs"),
    Mutation("reload-drops-types-silently", "supervisor/registry.py",
             "    if not dropped:\n        return \"\"", "    if True:\n        return \"\"",
             ("tests/test_daemon.py", "-k", "drops_job_types"),
             "a reload names the job types it no longer serves"),
    Mutation("threads-compared-by-name", "supervisor/childlimits.py",
             "    others = frozenset((t.ident, t.name) for t", "    others = frozenset((0, t.name) for t",
             ("tests/test_master_robustness.py", "-k", "non_daemon_thread"),
             "a reload's new thread of the same name is named before the fork too"),
    Mutation("master-waits-for-handler-threads", "supervisor/childlimits.py",
             "    if not stuck:\n        return code", "    if True:\n        return code",
             ("tests/test_master_robustness.py", "-k", "non_daemon_thread"),
             "a handler module's non-daemon thread does not keep the stopped master alive"),
    Mutation("reload-imports-untried", "supervisor/master/trial.py",
             "    problem = trial(folder, generation, heartbeat, cfg.supervisor.import_timeout, signals)", "    problem = None",
             ("tests/test_daemon.py", "-k", "broken_config_or_handler and at_import"),
             "a handler module that ends or freezes the process importing it fails the reload, not the master"),
    Mutation("sqlite-claim-walks-scheduled-jobs", "supervisor/backends/sqlite/ready.py",
             "PRIORITY_PROBES = 16", "PRIORITY_PROBES = 0",
             ("tests/test_sqlite_broker.py", "-k", "scheduled_for_later"),
             "a SQLite claim reads none of the jobs scheduled for later"),
    Mutation("postgres-claim-walks-scheduled-jobs", "supervisor/backends/postgres/control_schema.py",
             "PRIORITY_PROBES = 16  #", "PRIORITY_PROBES = 0  #",
             ("tests/test_postgres_broker.py", "-k", "scheduled_for_later"),
             "a PostgreSQL claim reads none of the jobs scheduled for later"),
    Mutation("sqlite-fork-uses-inherited", "supervisor/backends/sqlite/__init__.py",
             "        if self._pid != os.getpid():\n            self._forget_inherited()\n            with errors",
             "        if False:\n            self._forget_inherited()\n            with errors",
             ("tests/test_sqlite_broker.py", "-k", "fork"),
             "a broker used in a forked child opens its own connection (SQLite)"),
    Mutation("sqlite-fork-keeps-inherited-open", "supervisor/backends/sqlite/database.py",
             "    if db.in_transaction:\n        _INHERITED.append(db)",
             "    if True:\n        _INHERITED.append(db)",
             ("tests/test_sqlite_broker.py", "-k", "fork"),
             "a forked child's own SQLite connection takes real locks (the inherited one closed first)"),
    Mutation("sqlite-expiry-unbounded", "supervisor/backends/sqlite/control.py",
             '{"now": now, "queue": queue, "left": left}', '{"now": now, "queue": queue, "left": -1}',
             ("tests/test_sqlite_broker.py", "-k", "expired"),
             "one claim ends at most EXPIRE_BATCH expired jobs (SQLite)"),
    Mutation("sqlite-claim-leases-expired-backlog", "supervisor/backends/sqlite/ready.py",
             '_UNEXPIRED = "AND (expires_at IS NULL OR expires_at > ?)"', '_UNEXPIRED = "AND ? IS NOT NULL"',
             ("tests/test_sqlite_broker.py", CONTROL, "-k", "sqlite_broker or (sqlite and backlog)"),
             "a claim leases no job past its expiry that the bounded expiry left (SQLite)"),
    Mutation("sqlite-wal-no-size-limit", "supervisor/backends/sqlite/database.py",
             '    db.execute(f"PRAGMA journal_size_limit={JOURNAL_SIZE_LIMIT}")', "    pass",
             ("tests/test_sqlite_broker.py", "-k", "wal_file"),
             "the WAL file shrinks back to its limit once checkpointed (SQLite)"),
    Mutation("sqlite-prune-no-wal-truncate", "supervisor/backends/sqlite/__init__.py",
             "            truncate_wal(self.db, self._options[1])", "            pass",
             ("tests/test_sqlite_broker.py", "-k", "wal_file"),
             "prune empties the WAL when nobody is using it (SQLite)"),
    Mutation("prune-chore-whole-backlog", "supervisor/master/periodic.py",
             "        if deleted >= PRUNE_BUDGET:\n            self.next_prune_at = now", "        if False:\n            pass",
             ("tests/test_master_robustness.py", "-k", "prune_chore"),
             "the prune chore comes back the next turn while a backlog remains"),
    Mutation("prune-ignores-budget", "supervisor/backends/sqlite/__init__.py",
             "            while budget is None or total < budget:", "            while True:",
             (CONFORMANCE, "-k", "sqlite and prune_with_a_budget"),
             "one prune call deletes at most about its budget (SQLite)"),
    Mutation("client-calls-unguarded", "supervisor/client.py",
             "        with self._lock:\n            if self._busy:",
             "        if True:\n            if False:",
             ("tests/test_client_threads.py", "-k", "exactly_once"),
             "threads sharing one Client never join each other's transaction: every id returned is stored"),
    Mutation("schema-dumps-init-false-fields", "supervisor/schemas.py",
             "for f in dataclasses.fields(value) if f.init}", "for f in dataclasses.fields(value)}",
             ("tests/test_schemas.py", "-k", "init_false"),
             "a dataclass with a field(init=False) is enqueued without it and rebuilt by the class"),
    Mutation("schema-post-init-error-raw", "supervisor/schemas.py",
             "    except (ValueError, TypeError) as exc:  # its __post_init__ refused the values",
             "    except ():  # its __post_init__ refused the values",
             ("tests/test_schemas.py", "-k", "refuses_its_values"),
             "a dataclass's __post_init__ refusing the payload is BadInput at enqueue, bad_payload in the child"),
    Mutation("schema-literal-ignores-type", "supervisor/schemas.py",
             "(type(value) is type(a) or type(a) not in _SCALARS)", "True",
             ("tests/test_schemas.py", "-k", "literal"), "Literal[1, 2] refuses true and 1.0"),
    Mutation("payload-int-keys-converted", "supervisor/jsonvalues.py",
             "    if bad is not None:\n", "    if False:\n",
             ("tests/test_schemas.py", "-k", "non_string_key"),
             "a payload's or result's non-string key is refused naming its path, never converted to a string"),
    Mutation("run-jobs-ignores-result-limit", "supervisor/testing.py",
             "json.loads(child.reply_frame(reply)[4:])", "json.loads(protocol.encode(reply)[4:])",
             ("tests/test_testing.py", "-k", "cannot_store"),
             "run_jobs fails a result over the message limit (result_too_large), as the daemon does"),
    Mutation("postgres-flow-key-race-refused", "supervisor/backends/postgres/workflows.py",
             "            for _ in range(5):\n                try:\n                    with db.transaction():",
             "            for _ in range(1):\n                try:\n                    with db.transaction():",
             ("tests/test_postgres_broker.py", "-k", "racing_another"),
             "a workflow racing another producer for its idempotency key gets the holder's id (PostgreSQL)"),
    Mutation("client-call-inside-own-call", "supervisor/client.py",
             "            if self._busy:\n                raise RuntimeError", "            if False:\n                raise RuntimeError",
             ("tests/test_client_threads.py", "-k", "refused"),
             "a call from a thread already in a call of the same client is refused, not run inside it"),
    Mutation("start-failure-waits-for-threads", "supervisor/master/__init__.py",
             "    return childlimits.leave(_supervise(cfg))", "    return _supervise(cfg)",
             ("tests/test_master_robustness.py", "-k", "start_that_fails"),
             "a start that fails after a handler module started a thread still exits"),
    Mutation("children-ignore-sighup-for-their-programs", "supervisor/child/worker.py",
             "    signal.signal(signal.SIGHUP, _not_ours)", "    signal.signal(signal.SIGHUP, signal.SIG_IGN)",
             ("tests/test_daemon.py", "-k", "whole_group"),
             "a program a job starts does not inherit SIGHUP ignored"),
    Mutation("start-up-sighup-forgotten", "supervisor/master/arbiter.py",
             "        self.signals.extend(held)", "        pass",
             ("tests/test_daemon.py", "-k", "while_the_handlers_import"),
             "a SIGHUP during start-up is applied as a reload once up"),
    Mutation("trial-ignores-stop-signals", "supervisor/master/trial.py",
             "    watch = [r] + ([signals[0]] if signals else [])", "    watch = [r]",
             ("tests/test_daemon.py", "-k", "stop_signal_during"),
             "a stop signal during a reload's trial import is not kept waiting"),
    Mutation("trial-waits-for-pipe-end", "supervisor/master/trial.py",
             "            if done:\n                break", "            if done and r not in watch:\n                break",
             ("tests/test_daemon.py", "-k", "helper_process"),
             "the trial's verdict is its process's end, not its pipe's (a helper may hold that)"),
    Mutation("trial-leaves-its-helpers", "supervisor/master/trial.py",
             "                os.killpg(pid, signal.SIGKILL)  # what a module", "                pass  # what a module",
             ("tests/test_daemon.py", "-k", "helper_process"),
             "a helper process the trial's import started ends with the trial"),
    Mutation("postgres-prune-batch-past-budget", "supervisor/backends/postgres/__init__.py",
             "        batch = int(self.prune_batch) if budget is None else max(1, min(int(self.prune_batch), int(budget)))",
             "        batch = int(self.prune_batch)",
             ("tests/test_postgres_broker.py", "-k", "prune_deletes_in_batches"),
             "one PostgreSQL prune call deletes about its budget, not a whole batch of 10,000"),
    Mutation("client-wait-broker-per-call", "supervisor/client.py",
             "        try:\n            broker = self._wait_brokers.pop()\n        except IndexError:\n            broker = open_broker(self.url)",
             "        broker = open_broker(self.url)",
             ("tests/test_client_threads.py", "-k", "reuse_their_broker"),
             "a Client opens a new broker (two server connections on PostgreSQL) for every wait"),
    Mutation("postgres-kept-waiter-trusted", "supervisor/backends/postgres/connection.py",
             "            try:\n                conn.execute(f\"LISTEN {quote(channel)}\")\n                return conn\n            except psycopg.Error:",
             "            try:\n                conn.execute(f\"LISTEN {quote(channel)}\")\n                return conn\n            except ZeroDivisionError:",
             ("tests/test_postgres_broker.py", "-k", "one_after_another"),
             "a wait fails when the connection the last wait kept was closed by the server meanwhile"),
    Mutation("sqlite-limited-leased-full-scan", "supervisor/backends/sqlite/__init__.py",
             "FROM jobs INDEXED BY jobs_leased WHERE state = 'running'",
             "FROM jobs WHERE state = 'running'",
             ("tests/test_sqlite_broker.py", "-k", "scheduled_for_later"),
             "a SQLite claim under type limits reads every job to count the running ones"),
    Mutation("postgres-limited-claim-one-scan", "supervisor/backends/postgres/ready.py",
             "    for _ in range(PRIORITY_PROBES):",
             "    for _ in range(0):",
             ("tests/test_postgres_broker.py", "-k", "under_type_limits_reads_none"),
             "a PostgreSQL claim under type limits walks every job scheduled for later"),
    Mutation("redis-flow-parent-twice-by-key", "supervisor/backends/redis_lua/enqueue_flow.lua",
             "    if not seen[parent] then", "    if true then",
             ("tests/test_conformance_workflows.py", "-k", "redis and idempotency_key_maps"),
             "a callback whose members one idempotency key maps to one job fires after it (Redis waited for ever)"),
    Mutation("postgres-resend-returns-key-holder", "supervisor/backends/postgres/__init__.py",
             "                if job.id in existing_ids:  # before the key",
             "                if job.id in existing_ids and job.idempotency_key not in by_key:  # before the key",
             ("tests/test_conformance_workflows.py", "-k", "postgres and resend_of_a_job"),
             "a resend of a job it named returns its id, not the job that took its key since (PostgreSQL)"),
    Mutation("sqlite-deleted-parent-edges-live", "supervisor/backends/sqlite/workflows.py",
             "    UPDATE job_edges SET parent_gone = 1 WHERE parent = OLD.id AND OLD.state IN {_FINISHED};\n", "",
             ("tests/test_conformance_workflows.py", "-k", "sqlite and deleted_parent"),
             "a new job given a pruned or purged parent's id settles that parent's edges: its child is released"
             " (or cancelled) though another parent never ran, and reads the new job's result"),
    Mutation("redis-prune-replayable-child", "supervisor/backends/redis_lua/prune.lua",
             "    if z == CANCELLED_Z and replayable(JOB .. id, id) then", "    if false then",
             ("tests/test_conformance_workflows.py", "-k", "redis and parent_still_dead"),
             "prune deletes a child cancelled by a parent still dead: replaying the parent never runs it"),
    Mutation("decorator-schedule-ignores-type-queue", "supervisor/scheduler.py",
             "{}, cfg.job_type(type_name).queue or spec.queue)", "{}, spec.queue)",
             ("tests/test_scheduling.py", "-k", "decorator_schedule_goes"),
             "a decorator's cron enqueues to [jobs.types.<type>].queue, as .enqueue() does, not the decorator's"),
    Mutation("cron-check-skips-past-tick", "supervisor/checks.py",
             "            croniter.croniter(v).get_prev()", "            pass",
             ("tests/test_scheduling.py", "-k", "cannot_run and year"),
             "a cron with no tick before now (a year to come) is refused at config check, start and reload"),
    Mutation("schedule-cron-error-reaches-broker-link", "supervisor/scheduler.py",
             "        try:\n            return compute(*args)\n        except Exception as exc:",
             "        try:\n            return compute(*args)\n        except ZeroDivisionError as exc:",
             ("tests/test_scheduling.py", "-k", "cron_fails and sqlite"),
             "a schedule whose cron fails is skipped alone, never read as a broker outage pausing claims"),
    Mutation("cron-random-accepted", "supervisor/checks.py",
             "    if isinstance(v, str) and any(_HASHED.fullmatch(item)",
             "    if False and any(_HASHED.fullmatch(item)",
             ("tests/test_scheduling.py", "-k", "cannot_run and random"),
             "an R (random) or H (hashed) cron field is refused: supervisors must agree on every tick"),
    Mutation("schedule-payload-unchecked", "supervisor/scheduler.py",
             "        if spec is None or spec.payload is None:\n            continue",
             "        if True:\n            continue",
             ("tests/test_scheduling.py", "-k", "cannot_run and payload"),
             "a schedule's payload its handler's schema refuses is refused at config check, start and reload"),
    Mutation("reload-forgets-schedule-checks", "supervisor/master/periodic.py",
             "            new.carry_over(self.scheduler)", "            pass",
             ("tests/test_scheduling.py", "-k", "reload_keeps_the_last_check"),
             "a reload forgets each schedule's last check: with catch_up = 0 a tick due during it is lost"),
    Mutation("new-schedule-catches-up-its-past", "supervisor/scheduler.py",
             "after, count = (now, 0) if newest is None", "after, count = (float('-inf'), sched.catch_up) if newest is None",
             ("tests/test_scheduling.py", "-k", "new_schedule_starts_from_now"),
             "a new schedule enqueues its latest catch_up ticks from before it existed, at once"),
    Mutation("schedule-tick-unbounded", "supervisor/scheduler.py",
             "            if len(ticks) > budget:", "            if False:",
             ("tests/test_scheduling.py", "-k", "at_most_its_budget"),
             "one tick() call (one turn of the master's loop) enqueues every missed tick of a catch-up"),
    Mutation("dst-fall-back-runs-twice", "supervisor/scheduler.py",
             "zoneinfo.ZoneInfo(self.timezone)).fold == 1", "zoneinfo.ZoneInfo(self.timezone)).fold == 2",
             ("tests/test_scheduling.py", "-k", "clocks_go_back"),
             "a fixed-time schedule (0 2 * * *) runs twice on the night the clocks go back"),
    Mutation("redis-once-per-queue", "supervisor/backends/redis/__init__.py",
             "        job = self._once_queue(job, schedule)", "        pass",
             (CONFORMANCE, "-k", "redis and once_across_queues"),
             "Redis enqueues a tick again when its type moved to another queue (the record was per queue)"),
    Mutation("queue-sample-in-main-loop", "supervisor/master/periodic.py",
             "        self.prune()\n",
             "        self.prune()\n        self.link.call(lambda br: br.stats(self.cfg.broker.queues), \"stats\")\n",
             ("tests/test_metrics.py", "-k", "every_counter"),
             "the main loop counts every job kept in each state (1.5 s at 3 million dead letters), deaf meanwhile"),
    Mutation("queue-sample-pace-fixed", "supervisor/heartbeat.py",
             "max(SAMPLE_SECONDS, (clock() - started) / SAMPLE_SHARE)", "SAMPLE_SECONDS",
             ("tests/test_metrics.py", "-k", "slow_queue_sample"),
             "a queue sample that takes seconds is taken again every 5 s: the broker counts all the time"),
    Mutation("sqlite-stats-unbounded", "supervisor/backends/sqlite/__init__.py",
             "interrupted_after(self.db, within)", "interrupted_after(self.db, None)",
             (CONFORMANCE, "-k", "sqlite and stats_within"),
             "SQLite's queue counts ignore their bound: the heartbeat's sample can hold up the renewals"),
    Mutation("postgres-stats-unbounded", "supervisor/backends/postgres/__init__.py",
             "            if within is not None:  # the server cancels the counts past it",
             "            if False:",
             (CONFORMANCE, "-k", "postgres and stats_within"),
             "PostgreSQL's queue counts ignore their bound: the heartbeat's sample can hold up the renewals"),
    Mutation("heartbeat-sample-failure-raises", "supervisor/heartbeat.py",
             "        except BrokerError as exc:  # cut off, or the broker failed",
             "        except ZeroDivisionError as exc:  # cut off, or the broker failed",
             ("tests/test_postgres_broker.py", "-k", "cannot_count_in_time"),
             "a queue sample the broker gives up on ends the heartbeat thread: no lease is renewed again"),
    Mutation("sqlite-prune-forgets-schedule-ticks", "supervisor/backends/sqlite/__init__.py",
             '            self.db.execute("DELETE FROM once_keys WHERE created_at < ?", (cutoff,))\n',
             '            self.db.execute("DELETE FROM once_keys WHERE created_at < ?", (cutoff,))\n'
             '            self.db.execute("DELETE FROM schedule_ticks")\n',
             ("tests/test_scheduling.py", "-k", "retention and sqlite"),
             "a monthly schedule whose once-records were pruned (retention 7 days) looks new: its missed tick is lost"),
    Mutation("schedule-bad-record-reaches-broker-link", "supervisor/scheduler.py",
             "        tick = None if key is None else key_tick(name, key)",
             "        tick = None if key is None else datetime.datetime.strptime(key[-20:], STAMP).timestamp()",
             ("tests/test_scheduling.py", "-k", "no_tick and sqlite"),
             "a look-back record that is no tick (cron:<name>:manual) raises in tick(): the broker link pauses claims"),
    Mutation("sqlite-look-back-by-prefix", "supervisor/backends/sqlite/producing.py",
             '"SELECT key FROM schedule_ticks WHERE name = ?", (schedule,)',
             '"SELECT key FROM schedule_ticks WHERE name GLOB ? || \'*\' ORDER BY key DESC", (schedule,)',
             ("tests/test_scheduling.py", "-k", "name_it_prefixes and sqlite"),
             "report reads report:eu's newer tick as its own (a prefix match): it misses its own tick"),
    Mutation("redis-look-back-scans", "supervisor/backends/redis/once.py",
             "        return self.r.hget(self._once_keys()[2], schedule)",
             "        return next((v for k, v in self.r.hscan_iter(self._once_keys()[2]) if k == schedule), None)",
             ("tests/test_scheduling.py", "-k", "without_a_scan and redis"),
             "Redis's look-back scans records on the master's main loop (358 ms a schedule at 200,000 once-records)"),
]


def copy_repo(dest):
    skip = shutil.ignore_patterns(".git", ".venv", "__pycache__", "*.egg-info", ".pytest_cache", "*.pyc")
    shutil.copytree(ROOT, dest, ignore=skip)


def scratch_env(scratch):
    env = dict(os.environ, PYTHONPATH=scratch, PYTHONDONTWRITEBYTECODE="1")
    env.pop("TANGGUH_REQUIRE_SERVICES", None)
    return env


def check_import(scratch):
    out = subprocess.run([sys.executable, "-c", "import supervisor; print(supervisor.__file__)"], cwd=scratch,
                         env=scratch_env(scratch), capture_output=True, text=True, check=True)
    where = os.path.realpath(out.stdout.strip())
    if not where.startswith(os.path.realpath(scratch) + os.sep):
        raise SystemExit(f"mutations: the scratch run imports supervisor from {where}, not from {scratch}")


def apply(scratch, m):
    """Write the mutated file; return its original text. Raises LookupError when the anchor moved."""
    path = os.path.join(scratch, m.path)
    with open(path) as f:
        text = f.read()
    found = text.count(m.old)
    if found != 1:
        raise LookupError(f"anchor found {found} times in {m.path} (expected once): {m.old!r}")
    with open(path, "w") as f:
        f.write(text.replace(m.old, m.new))
    return text


def run_tests(scratch, m):
    """(pytest exit code, its summary line)."""
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "--no-header", *m.tests]
    out = subprocess.run(cmd, cwd=scratch, env=scratch_env(scratch), capture_output=True, text=True)
    lines = [line for line in out.stdout.splitlines() if line.strip()]
    summary = next((line.strip("= ") for line in reversed(lines) if re.search(r"\d+ (passed|failed|error|skipped|"
                                                                            r"deselected)", line)), "no summary")
    return out.returncode, summary


def check(scratch, m, baseline):
    """One row of the table: (verdict, summary, seconds)."""
    t0 = time.monotonic()
    if baseline:
        code, summary = run_tests(scratch, m)
        if code != 0:
            return "BASELINE FAILS", summary, time.monotonic() - t0
    try:
        original = apply(scratch, m)
    except LookupError as exc:
        return "ANCHOR MISSING", str(exc), time.monotonic() - t0
    try:
        code, summary = run_tests(scratch, m)
    finally:
        with open(os.path.join(scratch, m.path), "w") as f:
            f.write(original)
    if code == 1:
        verdict = "caught"
    elif code == 0:
        verdict = "SURVIVED"
    else:
        verdict = f"ERROR (pytest exit {code})"  # collection error, no test selected...
    return verdict, summary, time.monotonic() - t0


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m tests.mutations", description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print the mutations and exit")
    parser.add_argument("--only", action="append", metavar="NAME", help="run only this mutation (repeatable)")
    parser.add_argument("--baseline", action="store_true", help="first check each selection passes unmutated")
    args = parser.parse_args(argv)
    chosen = MUTATIONS
    if args.only:
        names = {m.name for m in MUTATIONS}
        unknown = [n for n in args.only if n not in names]
        if unknown:
            print(f"mutations: unknown mutation {', '.join(unknown)} (see --list)", file=sys.stderr)
            return 2
        chosen = [m for m in MUTATIONS if m.name in args.only]
    if args.list:
        for m in chosen:
            print(f"{m.name:32} {m.path:46} {' '.join(m.tests)}\n{'':32} breaks: {m.breaks}")
        return 0
    scratch = tempfile.mkdtemp(prefix="tangguh-mutations-")
    t0 = time.monotonic()
    rows = []
    try:
        copy_repo(os.path.join(scratch, "repo"))
        scratch = os.path.join(scratch, "repo")
        check_import(scratch)
        for m in chosen:
            verdict, summary, seconds = check(scratch, m, args.baseline)
            rows.append((m.name, " ".join(m.tests), verdict, summary, seconds))
            print(f"{m.name:32} {verdict:14} {seconds:6.1f}s  {' '.join(m.tests)}  [{summary}]", flush=True)
    finally:
        shutil.rmtree(os.path.dirname(scratch), ignore_errors=True)
    bad = [r for r in rows if r[2] != "caught"]
    print(f"\n{len(rows) - len(bad)} of {len(rows)} mutations caught in {time.monotonic() - t0:.0f}s")
    for name, tests, verdict, summary, _ in bad:
        print(f"  {verdict}: {name} ({tests}): {summary}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
