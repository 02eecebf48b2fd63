"""SQLite-only behaviour (the shared contract is in test_broker_conformance.py)."""
import select
import sys

import pytest

from supervisor.backends import open_broker
from supervisor.model import NewJob

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="inotify wake-ups are Linux-only")


def readable(fd, timeout=0.0):
    return bool(select.select([fd], [], [], timeout)[0])


def test_wakeup_fd_turns_readable_after_an_enqueue_elsewhere(tmp_path):
    url = f"sqlite:///{tmp_path}/broker.db"
    with open_broker(url) as supervisor_side, open_broker(url) as producer:
        fd = supervisor_side.wakeup_fd()
        assert fd is not None and supervisor_side.wakeup_fd() == fd
        supervisor_side.drain_wakeups()
        assert supervisor_side.claim(["default"], 1, 30, "w") == []  # an empty claim writes nothing...
        assert not readable(fd)  # ...so an idle supervisor does not wake itself
        producer.enqueue(NewJob("t", {}))
        assert readable(fd, 5.0)
        supervisor_side.drain_wakeups()
        assert not readable(fd)  # drained, and draining never blocks
        supervisor_side.drain_wakeups()
