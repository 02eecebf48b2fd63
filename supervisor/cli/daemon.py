"""The running supervisor: ``run``, ``status`` (``--watch``), ``metrics``, asked over its health socket."""
import json
import os
import sys
import time

from .. import config as config_module
from ..errors import ConfigError, TangguhError
from ..urls import redact
from .common import CLOSED_AT_START, PROG, Failure, UsageError, config_path, daemon_module, load_config
from .output import duration, print_json, printable, say, size, table, when


def cmd_run(args):
    return daemon_module("master").run(config_path(args))


def supervisor_socket(args):
    """The socket to ask: ``--socket``, else the config's; a broken config warns and is read leniently.

    The config is most often broken just after an edit and a reload, exactly
    when the operator needs ``status`` to see the running generation.
    """
    if args.socket:
        return os.path.abspath(args.socket)
    try:
        return load_config(args).supervisor.socket
    except ConfigError as exc:
        path = config_module.socket_path(args.config)
        print(f"{PROG}: warning: {printable(' '.join(str(exc).split()))}; asking the supervisor on {printable(path)}",
              file=sys.stderr)
        return path


# Longer than the loop's longest wait on a broker that stops answering: two tries in the turn the
# outage begins (a write's, then the claim's: 5 s each on Redis, 10 s on PostgreSQL by default),
# then one per backoff step. A supervisor that answers at all answers in milliseconds.
ANSWER_SECONDS = 25.0


def ask_supervisor(socket_path, request):
    """Send one request to the health socket; a Failure naming the socket when nobody answers."""
    health = daemon_module("health")
    try:
        reply = health.request(socket_path, request, timeout=ANSWER_SECONDS)
    except ValueError as exc:  # not JSON
        raise Failure(f"supervisor on {socket_path} sent an invalid reply ({exc})") from None
    except (OSError, TangguhError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        if isinstance(exc, TangguhError) and socket_path in reason:
            raise Failure(reason) from None  # already says which socket and what went wrong
        raise Failure(f"no supervisor answering on {socket_path} ({reason})") from None
    if not isinstance(reply, dict):
        raise Failure(f"supervisor on {socket_path} sent a reply that is not a JSON object")
    if reply.get("ok") is False:
        raise Failure(f"supervisor on {socket_path}: {reply.get('error') or 'request refused'}")
    return reply


def cmd_metrics(args):
    reply = ask_supervisor(supervisor_socket(args), {"cmd": "metrics"})
    text = reply.get("text", "")
    sys.stdout.write(text if text.endswith("\n") or not text else text + "\n")


WATCH_MAX = 86400


def cmd_status(args):
    if args.watch is not None and not 0 < args.watch <= WATCH_MAX:  # inf would overflow the sleep
        raise UsageError(f"status: --watch needs a positive number of seconds, at most {WATCH_MAX}")
    path = supervisor_socket(args)
    reply = ask_supervisor(path, {"cmd": "status"})
    if args.watch is None or "stdout" in CLOSED_AT_START:  # a watch nobody sees would sample forever
        print_json(reply) if args.json else say(render_status(reply))
        return
    pending = [reply]

    def fetch():
        if pending:
            return pending.pop()
        try:
            return ask_supervisor(path, {"cmd": "status"})
        except Failure as exc:  # keep watching across a restart
            return {"error": str(exc)}

    if not args.json:
        return daemon_module("cli.watch").run(fetch, args.watch)

    def write(reply):  # --json: one object a line (JSON Lines), for jq or a script; no screen to clear
        sys.stdout.write(json.dumps(reply, default=str) + "\n")
        sys.stdout.flush()

    return daemon_module("cli.watch").run_json(fetch, args.watch, write)


def render_status(reply, now=None):
    """The reply of ``{"cmd": "status"}`` as a readable report (pure: no I/O)."""
    if reply.get("error") and "workers" not in reply:
        return f"error: {reply['error']}"
    now = time.time() if now is None else now
    started = reply.get("started_at")
    up = f"up {duration(now - started)} (since {when(started)})" if isinstance(started, (int, float)) else ""
    version = f"  version {reply['version']}" if reply.get("version") else ""  # older daemons do not say
    lines = [f"supervisor pid {reply.get('pid', '-')}  generation {reply.get('generation', '-')}{version}"
             f"  {up}".rstrip()]
    for key in ("config", "broker"):
        lines.append(f"{key + ':':<8} {_flat(reply.get(key))}")
    state = ["stopping" if reply.get("stopping") else "running"]
    if reply.get("broker_down"):
        state.append("BROKER DOWN (not claiming, retrying the connection)")
    for key, label in (("target_workers", "target workers"), ("prefetched", "prefetched"),
                       ("pending_writes", "pending writes")):
        if key in reply:
            state.append(f"{label} {_flat(reply[key])}")
    lines.append(f"{'state:':<8} " + ", ".join(state))
    if "handlers" in reply:
        lines.append(f"{'types:':<8} {', '.join(map(str, reply['handlers'])) or '-'}")
    prefetch = reply.get("prefetch")
    if isinstance(prefetch, dict):  # older daemons do not say
        per_type = ", ".join(f"{_flat(t.get('type'))} {_flat(t.get('prefetch'))}" for t in prefetch.get("types") or []
                             if isinstance(t, dict))
        lines.append(f"{'prefetch:':<8} {_flat(prefetch.get('mode'))}" + (f" ({per_type})" if per_type else ""))
    if reply.get("paused_queues"):
        lines.append(f"{'paused:':<8} {', '.join(map(str, reply['paused_queues']))} (not claimed from)")
    if reply.get("reload_error"):
        lines.append(f"RELOAD FAILED (running the previous generation): {_flat(reply['reload_error'])}")
    workers = reply.get("workers") or []
    busy = sum(1 for w in workers if w.get("job_id"))
    lines.append(f"workers: {len(workers)} ({busy} busy)  restarts: {_flat(reply.get('restarts', 0))}")
    if workers:
        rows = [[w.get("slot"), w.get("pid"), w.get("state"), w.get("job_id") or "-", w.get("job_type") or "-",
                 w.get("attempt") if w.get("job_id") else "-",
                 duration(w.get("elapsed")) if w.get("job_id") and w.get("elapsed") is not None else "-",
                 _progress(w), size(w.get("rss_bytes")), w.get("jobs_done"), w.get("generation")]
                for w in workers]
        lines.append(table(["SLOT", "PID", "STATE", "JOB", "TYPE", "ATTEMPT", "ELAPSED", "PROGRESS", "RSS", "DONE",
                            "GEN"], rows))
    counters = reply.get("counters") or {}
    if counters:
        lines.append("counters: " + "  ".join(f"{k}={_flat(v)}" for k, v in sorted(counters.items())))
    return "\n".join(lines)


def _progress(worker):
    """``42% note`` of a worker's job (``ctx.progress``); ``cancelling`` once its cancel was sent."""
    text = ""
    if worker.get("job_id") and isinstance(worker.get("progress"), (int, float)):
        text = f"{worker['progress'] * 100:.0f}% {worker.get('progress_note') or ''}".strip()
    if worker.get("cancelling"):
        text = (text + " (cancelling)").strip()
    return text or "-"


def _flat(value):
    """A value of a status reply on one line."""
    if value is None:
        return "-"
    if isinstance(value, dict):
        return " ".join(f"{k}={_flat(v)}" for k, v in value.items()) or "-"
    if isinstance(value, (list, tuple)):
        return ",".join(_flat(v) for v in value) or "-"
    if isinstance(value, str) and "://" in value:
        return redact(value)
    return str(value)
