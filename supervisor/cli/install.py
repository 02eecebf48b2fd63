"""``tangguh config init --systemd``: install Tangguh as a systemd service.

What it sets up (and nothing else):

- the system group and user ``tangguh`` (no login, home ``/var/lib/tangguh``);
- ``/etc/tangguh/`` (root:tangguh 0750) with ``config.toml`` (root:tangguh
  0640: it may hold a broker password) and ``handlers/`` (root:tangguh 0750).
  Handlers are code the daemon runs, so the daemon's user can read them but
  not change them; an operator (root) drops them in;
- ``/etc/systemd/system/tangguh.service`` (0644) with ``ExecStart=`` pointing
  at the ``tangguh`` of the installation this command runs from.

``/var/lib/tangguh`` (the SQLite broker file) and ``/run/tangguh`` (the
health socket) are made by systemd from the unit (``StateDirectory=``,
``RuntimeDirectory=``), owned by the service user.

An existing config file and handlers are never touched; the unit file is
rewritten (local changes belong in ``systemctl edit tangguh`` drop-ins).
``--root DIR`` writes the files under DIR and leaves accounts and systemd
alone; ``--dry-run`` only prints what would be done.
"""
import grp
import os
import pwd
import re
import shlex
import shutil
import subprocess
import sys

from ..errors import BadInput, TangguhError
from .common import DATA

CONFIG_DIR = "/etc/tangguh"
CONFIG = "/etc/tangguh/config.toml"
HANDLERS = "/etc/tangguh/handlers"
UNIT = "/etc/systemd/system/tangguh.service"
STATE_DIR = "/var/lib/tangguh"
SOCKET = "/run/tangguh/tangguh.sock"

# The example config's relative paths, and where a service keeps them.
SERVICE_PATHS = {
    'handlers = "handlers"': f'handlers = "{HANDLERS}"',
    'socket = "tangguh.sock"': f'socket = "{SOCKET}"',
    'url = "sqlite:///tangguh.db"': f'url = "sqlite:///{STATE_DIR}/tangguh.db"',
}


# useradd's default NAME_REGEX: a name the unit's User=/Group= lines hold as they are.
ACCOUNT_NAME = re.compile(r"[a-z_][a-z0-9_-]{0,31}")
# Written into ExecStart= as it is: no character systemd would split at, quote or expand (%b, $X).
PLAIN_PATH = re.compile(r"[A-Za-z0-9_./+@:,=-]+")


class InstallError(TangguhError):
    """The installation cannot go on; the message says why."""


def unit_text(tangguh_bin, user="tangguh", group="tangguh"):
    """The unit file, with ``ExecStart=`` running ``tangguh_bin`` as ``user``:``group``."""
    with open(os.path.join(DATA, "tangguh.service"), encoding="utf-8") as f:
        text = f.read()
    replacements = {
        "ExecStart=/opt/tangguh/venv/bin/tangguh ": f"ExecStart={tangguh_bin} ",
        "\nUser=tangguh\n": f"\nUser={user}\n",
        "\nGroup=tangguh\n": f"\nGroup={group}\n",
    }
    for old, new in replacements.items():
        if text.count(old) != 1:
            raise InstallError(f"the packaged unit file has no single {old.strip()!r} line to fill in")
        text = text.replace(old, new)
    return text


def config_text():
    """The example config with the service's absolute paths."""
    with open(os.path.join(DATA, "config.example.toml"), encoding="utf-8") as f:
        text = f.read()
    for old, new in SERVICE_PATHS.items():
        if text.count(f"\n{old}\n") != 1:
            raise InstallError(f"the packaged example config has no single {old!r} line to fill in")
        text = text.replace(f"\n{old}\n", f"\n{new}\n")
    return text


def default_tangguh_bin():
    """The ``tangguh`` script beside the running Python (the venv's), else the one on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "tangguh")
    if os.access(beside, os.X_OK):
        return beside
    found = shutil.which("tangguh")
    if found:
        return os.path.abspath(found)
    raise InstallError("cannot find the tangguh command; name it with --exec /path/to/venv/bin/tangguh")


class Installer:
    def __init__(self, root="/", user="tangguh", group="tangguh", tangguh_bin=None, dry_run=False, out=print):
        self.root = os.path.abspath(root)
        self.user, self.group = user, group
        self.tangguh_bin = tangguh_bin or default_tangguh_bin()
        if not os.path.isabs(self.tangguh_bin):
            raise BadInput(f"--exec {self.tangguh_bin}: must be an absolute path")
        if not PLAIN_PATH.fullmatch(self.tangguh_bin):
            raise BadInput(f"--exec {self.tangguh_bin!r}: ExecStart= would split, quote or expand it (a space,"
                           " a quote, % or $); install under a plain path, e.g. /opt/tangguh/venv")
        if self.tangguh_bin.startswith(("/home/", "/root/", "/run/user/")):
            # The unit has ProtectHome=yes: the service could not even see it.
            raise BadInput(f"{self.tangguh_bin}: a venv under a home directory is invisible to the service "
                           "(ProtectHome=yes); install it under /opt, e.g. /opt/tangguh/venv")
        if self.tangguh_bin.startswith(("/tmp/", "/var/tmp/")):
            # PrivateTmp=yes: the service gets empty ones of its own, so ExecStart= failed (203/EXEC).
            raise BadInput(f"{self.tangguh_bin}: a venv under /tmp or /var/tmp is invisible to the service "
                           "(PrivateTmp=yes); install it under /opt, e.g. /opt/tangguh/venv")
        for option, name in (("--user", user), ("--group", group)):
            if not ACCOUNT_NAME.fullmatch(name):
                raise BadInput(f"{option} {name!r}: not an account name (lowercase letters, digits, _ and -)")
        self.dry_run = dry_run
        self.out = out
        self.system = self.root == "/"  # accounts and systemctl only for the real system

    def path(self, path):
        return os.path.join(self.root, path.lstrip("/"))

    def run(self):
        config, unit = config_text(), unit_text(self.tangguh_bin, self.user, self.group)  # fail before any change
        self.ensure_accounts()
        self.make_dir(CONFIG_DIR, 0o750)
        self.write_file(CONFIG, config, 0o640, replace=False)
        self.make_dir(HANDLERS, 0o750)
        self.write_file(UNIT, unit, 0o644, replace=True, group_owned=False)
        self.daemon_reload()
        self.out("next: systemctl enable --now tangguh   (logs: journalctl -u tangguh)")

    # -- steps -------------------------------------------------------------------
    def ensure_accounts(self):
        commands = []
        if not _group_exists(self.group):
            commands.append(["groupadd", "--system", self.group])
        if not _user_exists(self.user):
            commands.append(["useradd", "--system", "--gid", self.group, "--home-dir", STATE_DIR,
                             "--no-create-home", "--shell", "/usr/sbin/nologin", "--comment",
                             "Tangguh worker-queue supervisor", self.user])
        for command in commands:
            shown = shlex.join(command)
            if not self.system:
                self.out(f"skipped under --root (accounts belong to the running system): {shown}")
            elif self.dry_run:
                self.out(f"would run: {shown}")
            else:
                self.out(f"running: {shown}")
                result = subprocess.run(command, capture_output=True, text=True)
                if result.returncode != 0:
                    raise InstallError(f"{shown} failed: {result.stderr.strip() or result.returncode}")
        if not commands:
            self.out(f"user {self.user} and group {self.group} exist")

    def gid(self):
        """The group's id; -1 (no change) under --root when this system has no such group: the
        files are for another system (a package), whose installation sets their group."""
        try:
            return grp.getgrnam(self.group).gr_gid
        except KeyError:
            if self.system:
                raise InstallError(f"group {self.group!r} does not exist") from None
            return -1

    def make_dir(self, path, mode):
        target = self.path(path)
        if self.dry_run:
            self.out(f"would create {target} (mode {mode:04o}, {self.group_note()})")
            return
        os.makedirs(target, mode=mode, exist_ok=True)
        os.chmod(target, mode)
        os.chown(target, -1, self.gid())
        self.out(f"directory {target} (mode {mode:04o}, {self.group_note()})")

    def write_file(self, path, text, mode, replace, group_owned=True):
        target = self.path(path)
        exists = os.path.exists(target)
        if exists and not replace:
            self.out(f"kept the existing {target}")
            return
        verb = "replace" if exists else "write"
        owner = f", {self.group_note()}" if group_owned else ""
        if self.dry_run:
            self.out(f"would {verb} {target} (mode {mode:04o}{owner})")
            return
        os.makedirs(os.path.dirname(target), exist_ok=True)
        tmp = f"{target}.tangguh-new"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, mode)
        if group_owned:
            os.chown(tmp, -1, self.gid())
        os.replace(tmp, target)  # never a half-written config or unit
        self.out(f"{'replaced' if exists else 'wrote'} {target} (mode {mode:04o}{owner})")

    def group_note(self):
        if not self.system and not _group_exists(self.group):
            return f"group left as is: no group {self.group} here; the target system's installation sets it"
        return f"group {self.group}"

    def daemon_reload(self):
        if not self.system or self.dry_run or not os.path.isdir("/run/systemd/system"):
            self.out("then: systemctl daemon-reload")
            return
        subprocess.run(["systemctl", "daemon-reload"], check=False)
        self.out("ran: systemctl daemon-reload")


def _group_exists(name):
    try:
        grp.getgrnam(name)
        return True
    except KeyError:
        return False


def _user_exists(name):
    try:
        pwd.getpwnam(name)
        return True
    except KeyError:
        return False


def main(args):
    """Entry point for ``tangguh config init --systemd``."""
    if args.root == "":  # an unset variable: the files went under the current folder
        raise BadInput("--root needs a folder (leave it out for /)")
    Installer(root="/" if args.root is None else args.root, user="tangguh" if args.user is None else args.user,
              group="tangguh" if args.group is None else args.group, tangguh_bin=args.exec_path,
              dry_run=args.dry_run).run()
