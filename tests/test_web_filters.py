"""The console's Jobs filter, its bulk confirmation, the Queues page's paused queues and a job's
parents, over HTTP (``supervisor.web.app.build`` on a real broker; the form itself driven by a
browser in tests/test_web_browser.py).
"""
import html
import re
from urllib.parse import parse_qsl, urlsplit

import pytest

pytest.importorskip("starlette")

from starlette.testclient import TestClient  # noqa: E402

from supervisor.model import NewJob  # noqa: E402
from supervisor.web import app as web_app  # noqa: E402

from .test_web import ADMIN_PW, csrf_of, login, make_config  # noqa: E402
from .util import wait_for  # noqa: E402

HOSTILE_KEY = '"><script>alert(1)</script>&amp;'


@pytest.fixture
def console(tmp_path, broker):
    with TestClient(web_app.build(make_config(tmp_path, broker.url), sample_interval=0.05)) as client:
        yield client


def hidden_fields(page, form_id):
    """The (name, value) pairs of a form's hidden inputs, as a browser would send them."""
    form = re.search(rf'<form[^>]*id="{form_id}".*?</form>', page, re.S).group(0)
    return [(html.unescape(n), html.unescape(v))
            for n, v in re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)">', form)]


def as_form(pairs):
    """Pairs as the test client posts them: a name repeated is one key with a list."""
    form = {}
    for name, value in pairs:
        form.setdefault(name, []).append(value)
    return form


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


def test_the_confirmations_cancel_link_keeps_the_order_and_every_filter_field(console, broker):
    job_id = broker.enqueue(NewJob("export", {"n": 1}, idempotency_key="k-7", delay=3600).validate())
    login(console, "ada", ADMIN_PW)
    asked = [("state", "queued"), ("state", "retrying"), ("queue", "default"), ("type", "export"),
             ("idempotency_key", "k-7"), ("since", "1d"), ("where", "n=1"), ("order", "oldest")]
    page = console.get("/jobs", params=asked).text
    assert job_id in page
    form = hidden_fields(page, "bulk-form")
    confirm = console.post("/jobs/bulk", data=as_form(form + [("action", "cancel"), ("scope", "filter")]))
    assert confirm.status_code == 200 and re.search(r'id="confirm-count">1<', confirm.text)
    back = html.unescape(re.search(r'<a href="([^"]+)" class="button" id="confirm-back">', confirm.text).group(1))
    assert urlsplit(back).path == "/jobs" and sorted(parse_qsl(urlsplit(back).query)) == sorted(asked)
    done = console.post("/jobs/bulk", data=as_form(hidden_fields(confirm.text, "confirm-form")),
                        follow_redirects=False)
    assert done.status_code == 303 and sorted(parse_qsl(urlsplit(done.headers["location"]).query)) == sorted(asked)
    assert broker.get(job_id).state == "cancelled"
    # An order that is none of the two is left out of the link rather than carried on.
    bad = console.post("/jobs/bulk", data=as_form([*form, ("action", "cancel"), ("scope", "filter"),
                                                   ("order", "<b>sideways</b>")]))
    assert "order=" not in re.search(r'href="([^"]+)" class="button" id="confirm-back"', bad.text).group(1)


def test_a_paused_queue_the_last_sample_did_not_list_is_shown_and_resumed_by_resume_all(tmp_path, broker):
    # Paused from the command line after the console's last sample (here: its only one), in a queue
    # no job was ever in and the config does not name: the page and Resume all must still see it.
    broker.pause("busy", "cli")
    with TestClient(web_app.build(make_config(tmp_path, broker.url), sample_interval=3600)) as client:
        sampler = client.app.state.console.sampler
        wait_for(lambda: sampler.snapshot["at"] is not None, timeout=10, message="the console's first sample")
        broker.pause("ghost", "cli")
        login(client, "ada", ADMIN_PW)
        page = client.get("/queues").text
        for name in ("busy", "ghost"):
            row = re.search(rf'<tr data-queue="{name}">.*?</tr>', page, re.S)
            assert row and "paused" in row.group(0) and f'id="resume-{name}"' in row.group(0), name
        done = client.post("/queues/resume", data={"csrf": csrf_of(page)}, follow_redirects=False)
        assert done.status_code == 303 and broker.paused() == {}


def test_pause_all_pauses_a_queue_that_appeared_since_the_last_sample(tmp_path, broker):
    # Jobs enqueued to a new queue after the console's last sample (here: its only one): Pause all
    # must read the broker's queues at the click, not pause only those the sample listed.
    broker.enqueue(NewJob("export", {"n": 1}).validate())
    with TestClient(web_app.build(make_config(tmp_path, broker.url), sample_interval=3600)) as client:
        sampler = client.app.state.console.sampler
        wait_for(lambda: sampler.snapshot["at"] is not None, timeout=10, message="the console's first sample")
        broker.enqueue(NewJob("export", {"n": 2}, queue="fresh").validate())
        login(client, "ada", ADMIN_PW)
        page = client.get("/queues").text
        done = client.post("/queues/pause", data={"csrf": csrf_of(page)}, follow_redirects=False)
        assert done.status_code == 303
        assert {"default", "fresh"} <= set(broker.paused())


def test_a_job_page_lists_its_parents_with_links_and_their_states(console, broker):
    done = broker.enqueue(NewJob("charge", {"n": 1}).validate())
    (claimed,) = broker.claim(["default"], 1, 30, "test")
    broker.ack(claimed.lease, {"ok": True})
    hostile = broker.enqueue(NewJob("charge", {"n": 2}, id="<b>p&2</b>", delay=3600).validate())
    child = broker.enqueue(NewJob("receipt", {"n": 3}, depends_on=[done, hostile]).validate())
    plain = broker.enqueue(NewJob("receipt", {"n": 4}).validate())
    login(console, "ada", ADMIN_PW)
    page = console.get(f"/jobs/{child}").text
    rows = re.findall(r'<tr><td><a href="([^"]+)" class="mono">([^<]*)</a></td>'
                      r'<td><span class="state state-(\w+)">', page)
    assert sorted(rows) == sorted([(f"/jobs/{done}", done, "done"),
                                   ("/jobs/%3Cb%3Ep%262%3C/b%3E", "&lt;b&gt;p&amp;2&lt;/b&gt;", "queued")])
    assert "<b>p&2" not in page
    assert 'id="parents"' not in console.get(f"/jobs/{plain}").text
    assert broker.discard([done]) == {done: "discarded"}  # pruned since: its end as the child saw it
    gone = re.search(rf'<a href="/jobs/{done}" class="mono">{done}</a></td><td>(.*?)</td><td>(.*?)</td>',
                     console.get(f"/jobs/{child}").text)
    assert "record gone" in gone.group(1) and gone.group(2) == "done"
