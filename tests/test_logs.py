"""Log formatting: JSON lines carry a job's ids; under journald each line carries its priority."""
import json
import logging
import os

import pytest

from supervisor import logs


@pytest.fixture(autouse=True)
def restore_root_logger():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def _logger(stream, fmt, env):
    os.environ.pop("JOURNAL_STREAM", None)
    os.environ.update(env)
    try:
        logs.setup("debug", fmt, stream)
    finally:
        os.environ.pop("JOURNAL_STREAM", None)
    return logging.getLogger("tangguh.test")


def test_lines_to_the_journal_carry_their_syslog_priority(tmp_path):
    path = tmp_path / "journal"
    with open(path, "w") as stream:
        st = os.fstat(stream.fileno())
        log = _logger(stream, "json", {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"})
        log.warning("lease lost", extra=logs.job_fields({"id": "job_1", "type": "t", "attempt": 2}))
        log.info("job done")
        log.error("broker unreachable")
    lines = path.read_text().splitlines()
    assert [line[:3] for line in lines] == ["<4>", "<6>", "<3>"]
    record = json.loads(lines[0][3:])
    assert (record["job_id"], record["type"], record["attempt"]) == ("job_1", "t", 2)


def test_no_prefix_when_stderr_is_not_the_journal(tmp_path):
    with open(tmp_path / "a", "w") as stream, open(tmp_path / "b", "w") as other:
        st = os.fstat(other.fileno())  # JOURNAL_STREAM names another file: not ours
        log = _logger(stream, "text", {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"})
        log.warning("plain")
    assert not (tmp_path / "a").read_text().startswith("<")
