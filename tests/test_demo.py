"""``tangguh demo`` on a fresh install: the newcomer's tour must work and tell the truth."""
from .daemon import tangguh


def test_demo_tours_every_outcome_and_exits_zero():
    out = tangguh("demo", timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    assert "SIGKILLed child" in text
    assert "flaky             done on attempt 3, after 2 retries" in text
    assert "always_permanent  dead-lettered after 1 attempt(s): permanent" in text
    assert "sleep             done on attempt 2: recovered after its child was killed" in text
    assert "no_such_type      dead-lettered after 1 attempt(s): unknown_type" in text
    assert "restarts: 1" in text
    assert "exit code 0" in text


def test_unknown_demo_name_is_a_one_line_error():
    out = tangguh("demo", "nonsense")
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "unknown demo" in out.stderr
