"""The crash matrix, row by row, as the master decides it (supervisor/master/verdict.py).

Each case is one row of docs/design.md's "Failure semantics" table that is
about a job: how the attempt ended -> what is stored. The process tests
(test_daemon.py) show the same rows end to end with real children.
"""
import pytest

from supervisor.master.verdict import Ending, failure, judge
from supervisor.model import ACK, CANCELLED, DEAD, DROP, RELEASE, RETRY


def backoff(failures):
    return 10.0 * failures  # recognisable: the verdict must use it, not compute its own


OK = {"op": "result", "ok": True, "result": {"n": 1}, "duration": 0.1}


def error(kind, cls="ValueError", message="boom", **extra):
    return {"op": "result", "ok": False, "kind": kind, "error_class": cls, "message": message,
            "traceback": "Traceback ...", **extra}


ROWS = [
    ("cancelled: the handler raised Cancelled", 1, 5, Ending(reply=error("cancelled", "Cancelled"), cancel_sent=True),
     CANCELLED, None, None),
    ("cancelled: the handler returned after the cancel reached it", 1, 5,
     Ending(reply=dict(OK, cancelled=True), cancel_sent=True), CANCELLED, None, None),
    ("cancelled: a result that crossed the cancel stands", 1, 5, Ending(reply=dict(OK, cancelled=False),
                                                                      cancel_sent=True), ACK, None, None),
    ("cancelled: killed past cancel_grace", 1, 5, Ending(exit_how="signal SIGKILL", kill_reason="cancel",
                                                         cancel_sent=True), CANCELLED, None, None),
    ("cancelled: killed at a shutdown, not run again", 1, 5, Ending(exit_how="signal SIGKILL",
                                                                   kill_reason="shutdown", cancel_sent=True),
     CANCELLED, None, None),
    ("cancelled, but the lease was lost: nothing stored", 1, 5,
     Ending(exit_how="signal SIGKILL", kill_reason="lease_lost", cancel_sent=True), DROP, None, None),
    # (row, attempt, max_attempts, ending, op, reason, delay)
    ("handler returns", 1, 5, Ending(reply=OK), ACK, None, None),
    ("handler raises: retried with backoff", 2, 5, Ending(reply=error("exception")), RETRY, "exception", 20.0),
    ("handler raises on the last attempt: dead", 5, 5, Ending(reply=error("exception")), DEAD, "exception", None),
    ("handler raises RetryLater: its own delay, stored as exception", 1, 5,
     Ending(reply=error("retry_later", "LockBusy", delay=7.5)), RETRY, "exception", 7.5),
    # A delay that is no number of seconds: the backoff. "inf" parked the job for ever, "nan"
    # made a write no broker takes (retried until the lease ran out), a negative one skipped
    # the backoff, a string ended the master's loop.
    *[(f"handler raises RetryLater({bad!r}): the backoff instead", 2, 5,
       Ending(reply=error("retry_later", "X", delay=bad)), RETRY, "exception", 20.0)
      for bad in (float("inf"), float("nan"), -1e9, "soon", None, True)],
    ("handler raises RetryLater(1e300): at most ten years", 1, 5,
     Ending(reply=error("retry_later", "X", delay=1e300)), RETRY, "exception", 10 * 365 * 86400.0),
    ("Permanent: dead at once", 1, 5, Ending(reply=error("permanent", "Permanent")), DEAD, "permanent", None),
    ("bad payload: dead at once", 1, 5, Ending(reply=error("bad_payload", "BadPayload")), DEAD, "bad_payload", None),
    ("unknown type: dead at once", 1, 5, Ending(reply=error("unknown_type", "UnknownType")), DEAD, "unknown_type",
     None),
    ("soft timeout: retried", 1, 5, Ending(reply=error("timeout", "JobTimeout")), RETRY, "timeout", 10.0),
    ("child dies on the first attempt: again at once", 1, 5, Ending(exit_how="signal SIGKILL"), RETRY, "crashed",
     0.0),
    ("child dies on a later attempt: backoff", 3, 5, Ending(exit_how="signal SIGSEGV"), RETRY, "crashed", 20.0),
    ("child dies on the last attempt: dead", 5, 5, Ending(exit_how="exit code 1"), DEAD, "crashed", None),
    ("hard timeout: child killed", 1, 5, Ending(exit_how="signal SIGKILL", kill_reason="timeout", term_sent=True),
     RETRY, "timeout", 10.0),
    ("hard timeout: child answered SIGTERM in its grace", 1, 5,
     Ending(reply=error("timeout", "JobTimeout"), kill_reason="timeout", term_sent=True), RETRY, "timeout", 10.0),
    ("hard timeout on the last attempt: dead", 3, 3, Ending(exit_how="signal SIGKILL", kill_reason="timeout",
                                                              term_sent=True), DEAD, "timeout", None),
    ("lease lost, child killed: nothing stored", 1, 5, Ending(exit_how="signal SIGKILL", kill_reason="lease_lost"),
     DROP, None, None),
    ("lease lost beats a success that crossed the kill", 1, 5, Ending(reply=OK, kill_reason="lease_lost"), DROP,
     None, None),
    ("lease lost beats a hard timeout", 5, 5, Ending(exit_how="signal SIGKILL", kill_reason="lease_lost",
                                                     term_sent=True), DROP, None, None),
    ("stopped at shutdown: released, no attempt burnt", 5, 5, Ending(exit_how="signal SIGKILL",
                                                                      kill_reason="shutdown"), RELEASE, None, None),
    ("a reply that beat the shutdown kill still counts", 1, 5, Ending(reply=OK, kill_reason="shutdown"), ACK, None,
     None),
]


@pytest.mark.parametrize("row, attempt, max_attempts, ending, op, reason, delay", ROWS, ids=[r[0] for r in ROWS])
def test_each_row_of_the_crash_matrix(row, attempt, max_attempts, ending, op, reason, delay):
    outcome = judge(attempt, max_attempts, ending, backoff)
    assert (outcome.op, outcome.reason) == (op, reason)
    if op == RETRY:
        assert outcome.delay == delay
    if op in (RETRY, DEAD):
        assert outcome.failed and outcome.error_class and outcome.message
    else:
        assert not outcome.failed


def test_a_success_carries_its_result():
    assert judge(1, 5, Ending(reply=OK), backoff).result == {"n": 1}


def test_a_hard_timeout_says_how_the_child_ended_and_is_marked_hard():
    outcome = judge(1, 5, Ending(exit_how="signal SIGKILL", kill_reason="timeout", term_sent=True), backoff)
    assert outcome.hard_timeout and outcome.error_class == "HardTimeout"
    assert "signal SIGKILL" in outcome.message
    soft = judge(1, 5, Ending(reply=error("timeout", "JobTimeout")), backoff)
    assert soft.reason == "timeout" and not soft.hard_timeout


def test_a_crash_names_the_signal_and_keeps_no_traceback():
    outcome = judge(2, 5, Ending(exit_how="signal SIGSEGV"), backoff)
    assert outcome.error_class == "WorkerCrashed" and "signal SIGSEGV" in outcome.message
    assert outcome.traceback == ""


def test_the_handlers_error_is_kept_whole():
    outcome = judge(1, 5, Ending(reply=error("exception", "KeyError", "'order_id'")), backoff)
    assert (outcome.error_class, outcome.message, outcome.traceback) == ("KeyError", "'order_id'", "Traceback ...")


def test_a_failure_found_by_the_master_goes_through_the_same_rules():
    assert failure(1, 5, "unknown_type", "UnknownType", "no handler", backoff).op == DEAD
    assert failure(1, 1, "exception", "X", "y", backoff).op == DEAD
    assert failure(1, 5, "exception", "X", "y", backoff).delay == 10.0
