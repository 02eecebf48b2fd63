"""``tangguh web``: the console, and the two helpers that make its credentials."""
import errno
import getpass
import logging
import sys

from ..errors import BadInput, ConfigError
from .common import Failure, load_config

log = logging.getLogger("tangguh.web")


def _web_modules():
    try:
        from ..web import app, auth
    except ImportError as exc:
        raise Failure(f"the web console needs its extra: pip install 'tangguh[web]' ({exc})") from None
    return app, auth


def cmd_web(args):
    from .. import logs
    from ..checks import listen_address

    cfg = load_config(args)
    listen = args.listen or cfg.web.listen
    try:
        listen_address(listen)
    except ValueError as exc:
        raise BadInput(f"--listen: {exc}, got {listen!r}") from None
    app, auth = _web_modules()
    problem = auth.refuse_unsafe(cfg.web, listen)
    if problem:
        raise ConfigError(problem)
    try:
        sock = app.bind(listen)
    except OSError as exc:
        cause = (exc.strerror or str(exc)).lower()
        if exc.errno in (errno.EACCES, errno.EPERM):  # a port below 1024: no restart makes it allowed
            raise ConfigError(f"web: cannot listen on {listen}: {cause}") from None
        # Another process holds it (the console stopping, another service), or the address is not
        # up yet: exit 1, which systemd restarts, not 2.
        raise Failure(f"web: cannot listen on {listen}: {cause}") from None
    logs.setup(cfg.log.level, cfg.log.format)
    log.info("web console listening on http://%s (%s)", listen,
             "users and tokens from the config" if auth.auth_configured(cfg.web) else "open: loopback only",
             extra={"event": "web_start"})
    with sock:
        if not app.serve(cfg, sock):
            raise Failure("web: the console did not start (its log says why)")


def _read_secret(prompt):
    if not sys.stdin.isatty():  # piped: the first line (for scripts and tests), its CRLF too
        return sys.stdin.readline().rstrip("\r\n")
    first = getpass.getpass(prompt)
    if getpass.getpass("again: ") != first:
        raise BadInput("the two passwords differ")
    return first


def cmd_hash_password(args):
    _, auth = _web_modules()
    password = _read_secret("password: ")
    try:
        password.encode("utf-8")  # bytes that are no UTF-8 came in as surrogates: no one could type them again
    except UnicodeEncodeError:
        raise BadInput("password: not UTF-8 text") from None
    if len(password) < 8:
        raise BadInput("password: at least 8 characters")
    print(auth.hash_password(password))


def cmd_new_token(args):
    _, auth = _web_modules()
    token, digest = auth.new_token()
    print(f"token (give it to the script; it is not stored): {token}")
    print("for the config (name it; role \"viewer\" or \"admin\"):")
    print(f'[web.tokens.NAME]\nsha256 = "{digest}"\nrole = "viewer"')


def add_commands(commands, command):
    p = command(commands, "web", cmd_web, "run the web console (pip install 'tangguh[web]')")
    p.add_argument("--listen", metavar="HOST:PORT", help="address to listen on (default: the config's web.listen,"
                   " 127.0.0.1:9465)")
    sub = p.add_subparsers(dest="web_command", metavar="COMMAND")
    command(sub, "hash-password", cmd_hash_password,
            "print the argon2 hash of a password (read from the terminal, or the first line of stdin)")
    command(sub, "new-token", cmd_new_token, "make a bearer token for scripts and print its config line")
