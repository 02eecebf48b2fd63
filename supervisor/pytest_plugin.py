"""The pytest fixtures of ``supervisor.testing``, registered through the ``pytest11`` entry point.

Handlers come from the ``tangguh_handlers`` fixture: by default the folder the
``tangguh_handlers`` ini option names (relative to the rootdir); override the
fixture in a ``conftest.py`` to point elsewhere.
"""
import os

import pytest

# supervisor.testing (and the rest of the package) is imported by the fixtures, on first use:
# a test run that uses none of them pays nothing for this plugin.


def pytest_addoption(parser):
    parser.addini("tangguh_handlers", "the handlers folder the tangguh_* fixtures serve (relative to the rootdir)")


@pytest.fixture
def tangguh_handlers(request):
    """The handlers folder of the tests' supervisor."""
    value = request.config.getini("tangguh_handlers")
    if not value:
        pytest.fail("set the tangguh_handlers ini option, or override the tangguh_handlers fixture,"
                    " to name your handlers folder")
    return os.path.join(str(request.config.rootpath), value)


@pytest.fixture
def tangguh_config(tmp_path, tangguh_handlers):
    """The path of a config for this test: a fresh SQLite broker, the handlers folder, short backoffs.
    The test starts on real time: what an earlier test's ``run_jobs`` skipped is not carried over."""
    from . import testing

    testing.clock.offset = 0.0
    return testing.write_config(str(tmp_path), tangguh_handlers)


@pytest.fixture
def tangguh_broker(tangguh_config):
    """The test's temporary SQLite broker (a ``Broker``)."""
    from .backends.base import open_broker
    from .config import load

    broker = open_broker(load(tangguh_config).broker.url)
    yield broker
    broker.close()


@pytest.fixture
def tangguh_client(tangguh_config, tangguh_broker):
    """A ``Client`` on the test's broker, also the default client (``Handler.enqueue``) during the test."""
    from . import jobref, testing
    from .client import Client

    client = Client.from_config(tangguh_config)
    before = jobref.save()
    jobref.configure(client=client)
    testing.on_test_clock(client)
    yield client
    jobref.restore(before)
    client.close()


@pytest.fixture
def tangguh_supervisor(tangguh_config, tangguh_broker):
    """A real ``tangguh run`` on the test's broker with its handlers; stopped and checked at teardown
    (exit 0, no job leased, no worker left)."""
    from . import testing

    sup = testing.Supervisor(tangguh_config).start()
    yield sup
    sup.stop()
