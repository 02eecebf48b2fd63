"""The console's Jobs filter, its bulk confirmation, the Queues page's paused queues and a job's
parents, over HTTP (``supervisor.web.app.build`` on a real broker; the form itself driven by a
browser in tests/test_web_browser.py).
"""
import html
import re

import pytest

pytest.importorskip("starlette")

from starlette.testclient import TestClient  # noqa: E402

from supervisor.model import NewJob  # noqa: E402
from supervisor.web import app as web_app  # noqa: E402

from .test_web import ADMIN_PW, login, make_config  # noqa: E402

HOSTILE_KEY = '"><script>alert(1)</script>&amp;'


@pytest.fixture
def console(tmp_path, broker):
    with TestClient(web_app.build(make_config(tmp_path, broker.url), sample_interval=0.05)) as client:
        yield client


def test_every_chosen_state_and_an_idempotency_key_stay_in_the_filter_form_escaped(console, broker):
    mine = broker.enqueue(NewJob("export", {"n": 1}, idempotency_key=HOSTILE_KEY).validate())
    other = broker.enqueue(NewJob("export", {"n": 2}, idempotency_key="another").validate())
    login(console, "ada", ADMIN_PW)
    page = console.get("/jobs", params=[("state", "queued"), ("state", "retrying"),
                                        ("idempotency_key", HOSTILE_KEY)]).text
    checked = re.findall(r'<input type="checkbox" name="state" value="(\w+)" checked>', page)
    assert checked == ["queued", "retrying"]
    key = re.search(r'<input name="idempotency_key" id="f-key" value="([^"]*)"', page).group(1)
    assert html.unescape(key) == HOSTILE_KEY
    assert "<script>alert" not in page
    assert mine in page and other not in page
