"""Small helpers for tests: wait for a condition with a deadline instead of sleeping."""
import time


def wait_for(condition, timeout=10.0, interval=0.02, message="condition"):
    """Poll ``condition()`` until it returns a truthy value; fail after ``timeout`` seconds.
    ``message`` may be a callable: made only then, it can tell what the test saw at the failure."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for "
                                 f"{message() if callable(message) else message}")
        time.sleep(interval)
