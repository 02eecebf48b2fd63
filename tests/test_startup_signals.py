"""A stop signal while the master starts (its handler files importing, first in a trial process,
then in the master itself): SIGINT ended the master with a traceback (exit 1) during the trial
and as a handler load error (exit 2) during its own import; SIGTERM and SIGQUIT ended it by the
signal. Now each stops it at once, logged, exit 0, nothing left behind: no job has started yet."""
import os
import signal

import psutil
import pytest

from .daemon import Daemon
from .util import wait_for


@pytest.fixture
def daemon(tmp_path):
    d = Daemon(tmp_path)
    yield d
    d.stop()


def waits_at_import(daemon, where):
    """A module that, imported in ``where`` ("trial" or "master"), writes its pid to a marker
    file named after it and then waits a minute; the import timeout is longer."""
    with open(os.path.join(daemon.handlers, "waits.py"), "w") as f:
        f.write(f"import os, time\n\nwhere = 'master' if os.getppid() == {os.getpid()} else 'trial'\n"
                f"with open(os.path.join({daemon.dir!r}, 'importing-' + where), 'a') as f:\n"
                "    f.write(f'{os.getpid()}\\n')\n"
                f"if where == {where!r}:\n"
                "    deadline = time.monotonic() + 60\n"
                "    while time.monotonic() < deadline:\n"
                "        time.sleep(0.01)\n")
    daemon.config["supervisor"]["import_timeout"] = 120.0
    daemon.write_config()
    return daemon.marker("importing-" + where)


@pytest.mark.parametrize("where", ["trial", "master"])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGQUIT])
def test_a_stop_signal_during_the_start_up_import_stops_the_master_cleanly(daemon, where, sig):
    importing = waits_at_import(daemon, where)
    daemon.start(wait=False)
    wait_for(lambda: os.path.exists(importing) and open(importing).read().endswith("\n"), timeout=30,
             message=f"the {where} import under way")
    importer = int(open(importing).read())
    daemon.signal(sig)
    assert daemon.wait_exit(timeout=20) == 0, daemon.logs()
    [stopped] = daemon.records(event="stop")
    assert stopped["msg"] == (f"supervisor stopped by {sig.name} during start-up (importing the handler files),"
                              " before any job ran") and stopped["exit_code"] == 0
    assert "Traceback" not in daemon.logs() and not daemon.records(event="start")
    assert not os.path.exists(daemon.socket)
    # The trial (a process group of its own) and what it forked are gone with the master.
    wait_for(lambda: not psutil.pid_exists(importer) or psutil.Process(importer).status() == psutil.STATUS_ZOMBIE,
             timeout=10, message="the importing process gone")
    wait_for(lambda: not daemon.group(), timeout=5, message="no process of the daemon left")

