"""The package's shape, held by tests: the master's parts stay parts, the
folders say what runs where, and no module grows past reading length.

Only the wiring (``supervisor/master/arbiter.py``) may know the other roles of
the master; each role gets its collaborators passed in. A part that imports
a sibling grows back into the one big class this package replaced.
"""
import ast
import pathlib
import subprocess
import sys

import pytest

import supervisor

PACKAGE = pathlib.Path(supervisor.__file__).parent
MASTER = PACKAGE / "master"
WIRING = {"arbiter.py", "__init__.py"}


def imported_modules(path, root=PACKAGE.parent):
    """Every module ``path`` imports, as absolute dotted names (``root`` holds the top package)."""
    tree = ast.parse(path.read_text(), str(path))
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module
            names.append(module)
            names += [f"{module}.{alias.name}" for alias in node.names]
    return names


def test_no_part_of_the_master_imports_another_part():
    parts = sorted(p for p in MASTER.glob("*.py") if p.name not in WIRING)
    assert len(parts) >= 6, "the master's roles are expected as modules of supervisor/master/"
    siblings = {f"supervisor.master.{p.stem}" for p in MASTER.glob("*.py")} | {"supervisor.master"}
    offenders = {p.name: sorted(set(imported_modules(p)) & siblings) for p in parts}
    assert {name: found for name, found in offenders.items() if found} == {}


def test_the_layout_check_sees_a_sibling_import(tmp_path):
    # The rule above must be able to fail: relative and absolute sibling imports are both found.
    probe = tmp_path / "supervisor" / "master" / "probe.py"
    probe.parent.mkdir(parents=True)
    probe.write_text("from .verdict import judge\nfrom . import outcomes\nimport supervisor.master.pool\n"
                     "from .. import protocol\n")
    found = set(imported_modules(probe, root=tmp_path))
    assert {"supervisor.master.verdict", "supervisor.master.outcomes", "supervisor.master.pool",
            "supervisor.protocol"} <= found


def test_no_module_is_over_400_lines():
    """Small modules, one concern each: a file past ~400 lines is doing two jobs."""
    sizes = {str(p.relative_to(PACKAGE)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert {name: n for name, n in sizes.items() if n > 400} == {}


def test_the_folders_say_what_runs_where():
    for folder, modules in {"cli": {"__main__", "daemon", "demo", "install", "watch"},
                            "child": {"worker", "context", "timeouts"},
                            "toolkit": {"connections", "idempotency", "locks", "cache", "transaction"}}.items():
        assert modules <= {p.stem for p in (PACKAGE / folder).glob("*.py")}, folder


def test_the_demos_import_each_other_one_way_only():
    # The tour does not know the invoices demo (the command picks the demo); the
    # invoices demo borrows the tour's polling helper.
    assert "supervisor.cli.demo_invoices" not in imported_modules(PACKAGE / "cli" / "demo.py")


def test_what_handlers_and_producers_import_stays_at_the_top():
    import supervisor.toolkit

    for name in ("job", "Client", "critical", "JobTimeout", "Permanent", "BadPayload", "RetryLater", "Transient",
                 "LockLost", "LockBusy", "LeaseLost", "TangguhError"):
        assert hasattr(supervisor, name), name
    for name in ("configure", "open_redis", "Database", "attach_master", "migrate", "database", "redis"):
        assert hasattr(supervisor.toolkit, name), name


def test_the_daemons_code_loads_neither_croniter_nor_asyncio_until_a_schedule_or_an_async_handler_needs_them():
    # Every module the master imports is in every child too (forked): croniter with dateutil
    # and asyncio are about 4 MiB that a daemon without schedules or async handlers never uses.
    heavy = ["croniter", "dateutil", "asyncio"]
    probe = ("import sys, supervisor.cli.daemon, supervisor.master.arbiter, supervisor.child.worker;"
             f" print([m for m in {heavy!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_daemons_code_loads_no_database_driver_nor_zoneinfo_until_a_broker_a_handler_or_a_schedule_needs_it():
    # The SQLite broker imports sqlite3 when it opens, the master imports the handlers' database
    # driver before it forks (toolkit.preload), a schedule imports zoneinfo at its first tick.
    heavy = ["sqlite3", "psycopg", "redis", "zoneinfo"]
    probe = ("import sys, supervisor.cli.daemon, supervisor.master.arbiter, supervisor.child.worker;"
             f" print([m for m in {heavy!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("argv", [["run", "-c", "{cfg}"], ["-c", "{cfg}", "run"], ["--config={cfg}", "run"],
                                  ["-c{cfg}", "run"]], ids=["after", "before", "equals", "attached"])
def test_the_run_command_builds_only_its_own_parser(argv, tmp_path):
    # `tangguh run` becomes the master, and every child is forked from it: the parsers and
    # modules of the other commands (about 0.4 MiB) would sit in each of those processes.
    # A missing config file stops the command after parsing, which is the part this probes.
    cfg = str(tmp_path / "missing.toml")
    probe = ("import sys; from supervisor import cli;"
             f" code = cli.main({[a.format(cfg=cfg) for a in argv]!r});"
             " print(code, sorted(m for m in sys.modules if m.startswith('supervisor.cli.') or m == 'getpass'))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stderr.strip() == f"tangguh: error: {cfg}: no such config file"
    assert out.stdout.split(" ", 1) == ["2", "['supervisor.cli.common', 'supervisor.cli.daemon',"
                                             " 'supervisor.cli.output', 'supervisor.cli.progress']\n"]
    # Any other command (and no command) still gets the whole parser.
    probe = "from supervisor import cli; cli.main(['--config', 'x.toml', 'status', '--bogus'])"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stderr.strip() == "tangguh: error: status: unrecognized arguments: --bogus"


def test_importing_supervisor_loads_neither_the_worker_nor_a_driver():
    # Handler modules and producers import supervisor: the child's worker (asyncio)
    # and the broker drivers load only where they are used.
    heavy = ["asyncio", "redis", "psycopg", "supervisor.child.worker", "supervisor.client"]
    probe = f"import sys, supervisor; print([m for m in {heavy!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
