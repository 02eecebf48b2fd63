"""Small helpers for tests: wait for a condition with a deadline instead of sleeping; URLs changed in one part."""
import time
import urllib.parse


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


def url_with(url, port=None, path=None):
    """``url`` with another port or path (``"/0"``, ``"/a_database"``), whatever server the
    TANGGUH_TEST_*_URL names: a test's bad URL must not depend on the default one."""
    parts = urllib.parse.urlsplit(url)
    netloc = parts.netloc
    if port is not None:
        netloc = netloc.rsplit(":", 1)[0] if parts.port is not None else netloc
        netloc = f"{netloc}:{port}"
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc, path=parts.path if path is None else path))
