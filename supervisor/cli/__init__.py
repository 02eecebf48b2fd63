"""The ``tangguh`` command line.

Every command takes ``-c/--config PATH`` (default ``./tangguh.toml``, else
``/etc/tangguh/config.toml``; with neither, only ``config show``/``check`` go on, on
the built-in defaults, and every other command refuses); commands that print data
take ``--json``. Exit codes: 0 ok, 1 runtime error (broker unreachable, job not
found, no supervisor answering, a bulk action stopped partway), 2 bad input,
usage or config error (nothing written), 141 stdout closed by its reader
(``| head``; quiet, as a SIGPIPE death). Every error is one line on stderr
(``tangguh: error: ...``; quoted values cut and escaped), and input is
checked before the broker is opened, so a rejected command writes nothing.
"""
import argparse
import atexit
import contextlib
import os
import sys

from ..errors import BadInput, ConfigError, NotDead, TangguhError
from .common import CLOSED_AT_START, HANDLER_THREADS, PROG, Failure, UsageError, job_id
from .output import printable
from .progress import stdout_gone


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        command = self.prog[len(PROG):].strip()
        raise UsageError(f"{command}: {message}" if command else message)

    def parse_known_args(self, args=None, namespace=None):
        parsed, extras = super().parse_known_args(args, namespace)
        if extras and self._subparsers is None:
            # Said here, by the command that did not take them: the top-level parser said it
            # without naming the command.
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras


# -- entry point ----------------------------------------------------------------

def main(argv=None):
    for name in ("stdout", "stderr"):
        if getattr(sys, name) is None:  # closed by the caller (`>&-`): written to nowhere, as print() does
            setattr(sys, name, open(os.devnull, "w"))  # (else a traceback, or errors printed on stdout)
            CLOSED_AT_START.add(name)
    code = _main(argv)
    # A thread a handler module started at import (config check, enqueue, schedules import them)
    # kept the command waiting at exit, its answer given, for as long as the thread ran.
    stuck = [t.name for t in HANDLER_THREADS if t.is_alive()]
    if not stuck:
        return code
    print(f"{PROG}: warning: not waiting for {len(stuck)} thread(s) a handler module started:"
          f" {printable(', '.join(stuck))}", file=sys.stderr)
    atexit._run_exitfuncs()  # as at a normal exit, but for the wait
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


def _main(argv):
    for stream in (sys.stdout, sys.stderr):
        # A job's text may hold what the terminal's encoding cannot show (a lone
        # surrogate): show it escaped rather than fail the whole listing.
        with contextlib.suppress(AttributeError, ValueError):
            stream.reconfigure(errors="backslashreplace")
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        # `run` becomes the daemon: its process (and every child forked from it) carries
        # only the parser and the modules of that command, not the twenty others'.
        args = (build_parser(only_run=True) if command_of(argv) == "run" else build_parser()).parse_args(argv)
        code = args.func(args) or 0
        sys.stdout.flush()  # here, not at interpreter exit: a closed pipe is caught below
        return code
    except BrokenPipeError:
        # The reader went away (`tangguh jobs | head -1`): what it wanted it has. Quiet, and
        # 141 like a command a shell saw die of SIGPIPE, so `set -o pipefail` scripts still see it.
        # (A bulk action never ends here: it stops and says how far it got, exit 1.)
        stdout_gone()
        return 141
    except UsageError as exc:
        return _fail(exc, 2)
    except (ConfigError, BadInput) as exc:
        return _fail(exc, 2)
    except (Failure, NotDead, TangguhError) as exc:
        return _fail(exc, 1)
    except OSError as exc:
        return _fail(f"{exc.filename + ': ' if exc.filename else ''}{exc.strerror or exc}", 1)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - the contract is one line, never a traceback
        if os.environ.get("TANGGUH_DEBUG"):
            raise
        return _fail(f"internal error: {type(exc).__name__}: {exc} (set TANGGUH_DEBUG=1 for a traceback)", 1)


ECHO_LIMIT = 1000  # characters of an error line: a 100 KB argument it quotes is cut, not echoed whole


def _fail(message, code):
    text = printable(" ".join(str(message).split()) or "failed", keep="")
    if len(text) > ECHO_LIMIT:
        text = f"{text[:ECHO_LIMIT]}... ({len(text) - ECHO_LIMIT} characters cut)"
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        stdout_gone()
    except ValueError:
        pass
    print(f"{PROG}: error: {text}", file=sys.stderr)
    return code


def command_of(argv):
    """The command named in ``argv`` (its first word after the top-level options), or None."""
    words = iter(argv)
    for word in words:
        if word in ("-c", "--config"):
            next(words, None)
        elif not word.startswith("-"):
            return word
        elif not word.startswith(("-c", "--config=")):
            return None  # --help, --version, --, a typo: the whole parser answers
    return None


def build_parser(only_run=False):
    from . import daemon

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-c", "--config", metavar="PATH", default=argparse.SUPPRESS,
                        help="config file (default: ./tangguh.toml, else /etc/tangguh/config.toml)")
    as_json = argparse.ArgumentParser(add_help=False)
    as_json.add_argument("--json", action="store_true", help="print JSON")
    to_socket = argparse.ArgumentParser(add_help=False)
    to_socket.add_argument("--socket", metavar="PATH", help="the supervisor's health socket (default: the config's"
                           " supervisor.socket; read leniently when the config file is broken)")

    parser = _Parser(prog=PROG, description="Tangguh: a pre-fork worker-queue supervisor.")
    parser.add_argument("--version", action="version", version=version_text())
    parser.add_argument("-c", "--config", metavar="PATH", default=None,
                        help="config file (default: ./tangguh.toml, else /etc/tangguh/config.toml)")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def command(parent, name, func, help, *parents):
        p = parent.add_parser(name, help=help, description=help, parents=[common, *parents])
        if func is not None:
            p.set_defaults(func=func)
        return p

    command(commands, "run", daemon.cmd_run, "run the supervisor in the foreground")
    if only_run:
        return parser
    from . import admin, bulk, control, dlq, flows, jobs, web

    p = command(commands, "enqueue", jobs.cmd_enqueue, "enqueue a job and print its id")
    p.add_argument("type", metavar="TYPE", help="job type (the handler's name)")
    p.add_argument("--payload", default="{}", metavar="JSON", help="payload: a JSON object (default {})")
    p.add_argument("--queue", metavar="Q", help="queue (default: the type's queue from the config)")
    p.add_argument("--resource-id", metavar="R", help="resource the job acts on")
    p.add_argument("--idempotency-key", metavar="K", help="returns the unfinished job with this key, if any")
    p.add_argument("--delay", type=float, default=0.0, metavar="S", help="seconds before the job is due")
    p.add_argument("--max-attempts", type=int, metavar="N", help="attempts before dead-lettering")
    p.add_argument("--timeout", type=float, metavar="S", help="hard timeout in seconds")
    p.add_argument("--priority", type=int, default=0, metavar="N", help="higher runs first within a queue")
    p.add_argument("--trace-id", metavar="T", help="trace id (default: a new one)")
    p.add_argument("--expires-in", type=float, metavar="S", help="not started within S seconds: ends expired")
    p.add_argument("--depends-on", action="append", default=[], metavar="ID",
                   help="wait until job ID is done (repeatable; ID:complete runs whatever its outcome)")

    command(commands, "status", daemon.cmd_status, "show the running supervisor's workers", as_json,
            to_socket).add_argument(
        "--watch", nargs="?", const=1.0, type=float, metavar="SECONDS", help="refresh every SECONDS (default 1)")
    command(commands, "metrics", daemon.cmd_metrics, "print the supervisor's Prometheus metrics", to_socket)
    command(commands, "stats", jobs.cmd_stats, "show per-queue counts", as_json)
    command(commands, "schedules", jobs.cmd_schedules, "list the periodic jobs with their next run", as_json)
    p = command(commands, "job", jobs.cmd_job, "show one job with its history", as_json)
    p.add_argument("job_id", metavar="ID", type=job_id)
    control.add_job_options(p)
    control.add_commands(commands, command, as_json)
    command(commands, "batch", flows.cmd_batch, "show a batch's counts (its id: its first callback's)",
            as_json).add_argument("batch_id", metavar="ID", type=job_id)

    bulk.add_commands(commands, command, as_json)

    dlq_commands = command(commands, "dlq", None, "inspect and replay dead-lettered jobs").add_subparsers(
        dest="dlq_command", metavar="COMMAND", required=True)
    p = command(dlq_commands, "list", dlq.cmd_dlq_list, "list dead jobs, most recently failed first", as_json)
    p.add_argument("--type", metavar="T", help="only jobs of this type")
    p.add_argument("--limit", type=int, default=100, metavar="N",
                   help="at most N jobs, most recently failed first (default 100, at most 1000; "
                   "0: every dead job, page by page, newest queued first)")
    command(dlq_commands, "show", dlq.cmd_dlq_show, "show a dead job: reason, error, attempts", as_json).add_argument(
        "job_id", metavar="ID", type=job_id)
    p = command(dlq_commands, "replay", dlq.cmd_dlq_replay, "put dead jobs back on their queue", as_json)
    p.add_argument("job_ids", nargs="*", metavar="ID", type=job_id)
    p.add_argument("--all", action="store_true", help="every dead job (of --type)")
    p.add_argument("--type", metavar="T", help="with --all: only jobs of this type")
    p.add_argument("--rate", type=float, metavar="N", help="at most N replays per second")
    p = command(dlq_commands, "purge", dlq.cmd_dlq_purge, "delete dead jobs for good", as_json)
    p.add_argument("job_ids", nargs="*", metavar="ID", type=job_id)
    p.add_argument("--all", action="store_true", help="every dead job (of --type); needs --yes")
    p.add_argument("--type", metavar="T", help="with --all: only jobs of this type")
    p.add_argument("--yes", action="store_true", help="confirm --all")

    cfg = command(commands, "config", None, "check, show or create a config file")
    cfg_commands = cfg.add_subparsers(dest="config_command", metavar="COMMAND", required=True)
    command(cfg_commands, "check", admin.cmd_config_check, "validate the config")
    command(cfg_commands, "show", admin.cmd_config_show, "print the effective config, defaults included", as_json
            ).add_argument("--show-secrets", action="store_true",
                           help="print URL passwords and credential hashes (masked by default)")
    p = command(cfg_commands, "init", admin.cmd_config_init, "write a starter config, or install the systemd service")
    p.add_argument("path", metavar="PATH", nargs="?", help="where to write the config (not with --systemd)")
    p.add_argument("--systemd", action="store_true",
                   help="install as a service: user, /etc/tangguh/{config.toml,handlers/}, the unit (docs/service.md)")
    p.add_argument("--root", metavar="DIR", help="with --systemd: write the files under DIR "
                   "(for packaging and tests); accounts and systemctl are left alone")
    p.add_argument("--user", metavar="NAME", help="with --systemd: service user (default tangguh)")
    p.add_argument("--group", metavar="NAME", help="with --systemd: service group (default tangguh)")
    p.add_argument("--exec", dest="exec_path", metavar="PATH",
                   help="with --systemd: the tangguh command for ExecStart= (default: this installation's)")
    p.add_argument("--dry-run", action="store_true", help="with --systemd: print what would be done, do nothing")

    db = command(commands, "db", None, "broker storage")
    db_commands = db.add_subparsers(dest="db_command", metavar="COMMAND", required=True)
    command(db_commands, "migrate", admin.cmd_db_migrate,
            "create or upgrade the broker's tables (and the toolkit's, if toolkit.database_url is set)")

    web.add_commands(commands, command)

    command(commands, "demo", admin.cmd_demo, "run a demonstration").add_argument(
        "args", nargs=argparse.REMAINDER, metavar="NAME", help="demo name and its arguments")
    return parser


def version_text():
    import platform

    from .. import __version__

    return f"{PROG} {__version__} (Python {platform.python_version()})"
