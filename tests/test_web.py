"""The web console without a browser: auth, roles, CSRF, redaction, headers, the API, outages.

Each test builds the real app (``supervisor.web.app.build``) on a real broker and
talks HTTP to it through Starlette's TestClient; the browser tests
(tests/test_web_browser.py) drive a real console process.
"""
import base64
import hashlib
import json
import logging
import re
import socket
import subprocess
import sys
import tomllib

import pytest

pytest.importorskip("starlette")

from starlette.testclient import TestClient  # noqa: E402

from supervisor import config  # noqa: E402
from supervisor.errors import ConfigError  # noqa: E402
from supervisor.logs import JsonFormatter  # noqa: E402
from supervisor.model import NewJob, error_info  # noqa: E402
from supervisor.web import app as web_app  # noqa: E402
from supervisor.web import auth, throttle  # noqa: E402

from .daemon import tangguh  # noqa: E402
from .servers import private_redis  # noqa: E402,F401 - a fixture
from .util import wait_for  # noqa: E402

SECRET = "4111-1111-1111-1111"
ADMIN_PW, VIEWER_PW = "admin-password", "viewer-password"
LOOPBACK = "http://127.0.0.1:9465"  # how a browser on this machine addresses an open console
HERE = ("127.0.0.1", 50000)  # and where its requests come from (TestClient's default is "testclient")
_HASHES = {}


def hashed(password):
    if password not in _HASHES:  # argon2 is slow on purpose: once per password per run
        _HASHES[password] = auth.hash_password(password)
    return _HASHES[password]


def make_config(tmp_path, broker_url, users=True, **web):
    data = {"broker": {"url": broker_url}, "web": {"redact": ["card_number"], **web}}
    if users:
        data["web"]["users"] = {"ada": {"password": hashed(ADMIN_PW), "role": "admin"},
                                "vic": {"password": hashed(VIEWER_PW), "role": "viewer"}}
    return config.from_dict(data, str(tmp_path))


def csrf_of(html):
    return re.search(r'name="csrf" value="([^"]+)"', html).group(1)


def login(client, name, password):
    token = csrf_of(client.get("/login").text)
    return client.post("/login", data={"name": name, "password": password, "csrf": token, "next": "/"},
                       follow_redirects=False)


def dead_job(broker, payload):
    job_id = broker.enqueue(NewJob("export", payload).validate())
    (claimed,) = broker.claim(["default"], 1, 30, "test")
    broker.dead(claimed.lease, "exception", error_info("exception", "ValueError", "boom",
                                                       "Traceback (most recent call last):\nValueError: boom"))
    return job_id


@pytest.fixture
def console(tmp_path, broker):
    cfg = make_config(tmp_path, broker.url)
    with TestClient(web_app.build(cfg, sample_interval=0.05)) as client:
        yield client


# -- config --------------------------------------------------------------------------

@pytest.mark.parametrize("users, message", [
    ({"ada": {"password": "hunter2hunter2", "role": "admin"}}, "never the password itself"),
    ({"ada": {"password": "$argon2id$x", "role": "root"}}, "role: expected one of admin, viewer"),
    ({"ada": {"role": "admin"}}, "password: required"),
    ({"a b": {"password": "$argon2id$x"}}, "is not a name"),
])
def test_bad_users_are_config_errors_that_never_echo_the_secret(tmp_path, users, message):
    with pytest.raises(ConfigError) as err:
        config.from_dict({"web": {"users": users}}, str(tmp_path))
    assert message in str(err.value) and "hunter2" not in str(err.value)


def test_a_non_loopback_address_without_users_is_refused_and_nothing_listens(tmp_path):
    cfg = tmp_path / "t.toml"
    cfg.write_text(f'[broker]\nurl = "sqlite:///{tmp_path}/b.db"\n')
    done = tangguh("web", "-c", str(cfg), "--listen", "0.0.0.0:9466", timeout=15)  # a started server would hang
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "not a loopback address" in done.stderr
    bad = tangguh("web", "-c", str(cfg), "--listen", "nowhere")
    assert bad.returncode == 2 and "--listen" in bad.stderr
    # Was served on [::1]:9466, the bracket dropped.
    bad = tangguh("web", "-c", str(cfg), "--listen", "[::1:9466", timeout=15)
    assert bad.returncode == 2 and "--listen: expected \"host:port\"" in bad.stderr
    assert auth.refuse_unsafe(make_config(tmp_path, "sqlite:///x.db").web, "0.0.0.0:9466") is None


def test_a_busy_address_is_one_line_naming_it_and_exit_1(tmp_path):
    """A port another process holds: uvicorn logged the bind error among its start-up lines (after
    "web console listening on ...") and exited 3, a code the CLI does not have."""
    cfg = tmp_path / "t.toml"
    cfg.write_text(f'[broker]\nurl = "sqlite:///{tmp_path}/b.db"\n')
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        listen = f"127.0.0.1:{held.getsockname()[1]}"
        done = tangguh("web", "-c", str(cfg), "--listen", listen, timeout=15)
    assert done.returncode == 1, done.stderr
    assert done.stderr.count("\n") == 1 and f"cannot listen on {listen}: address already in use" in done.stderr
    assert "listening" not in done.stderr


def test_hash_password_of_bytes_that_are_no_utf8_is_one_line_exit_2():
    """An internal error (UnicodeEncodeError) before: the hash of what could not be typed again."""
    done = subprocess.run([sys.executable, "-m", "supervisor.cli", "web", "hash-password"],
                          input=b"\xff\xfepassword1\n", capture_output=True, timeout=30)
    err = done.stderr.decode()
    assert done.returncode == 2 and err.count("\n") == 1 and "password: not UTF-8 text" in err, err
    assert done.stdout == b""


@pytest.mark.parametrize("ending", ["\n", "\r\n"])  # a line from a file saved on Windows: the CR was hashed
def test_hash_password_makes_a_hash_the_login_accepts(tmp_path, ending):
    done = tangguh("web", "hash-password", input="correct horse" + ending)
    assert done.returncode == 0 and done.stdout.startswith("$argon2")
    cfg = config.from_dict({"web": {"users": {"ada": {"password": done.stdout.strip(), "role": "viewer"}}}},
                           str(tmp_path))
    assert auth.check_password(cfg.web, "ada", "correct horse").role == "viewer"
    assert auth.check_password(cfg.web, "ada", "wrong") is None
    assert auth.check_password(cfg.web, "nobody", "correct horse") is None


# -- auth and roles -------------------------------------------------------------------

def test_pages_need_a_login_and_a_wrong_password_is_refused(console):
    assert console.get("/jobs", follow_redirects=False).headers["location"].startswith("/login")
    assert console.get("/api/overview").status_code == 401
    wrong = login(console, "ada", "not-the-password")
    assert wrong.status_code == 401 and "Wrong name or password" in wrong.text
    assert login(console, "ada", ADMIN_PW).status_code == 303
    for path in ("/", "/jobs", "/dead", "/queues", "/schedules", "/supervisors"):
        page = console.get(path)
        assert page.status_code == 200, path
        assert "ada" in page.text


def test_a_link_opened_without_a_session_comes_back_after_the_login_with_its_filter(console, broker):
    """The login sent a deep link (an alert's /jobs?state=dead&type=export) to /jobs, its filter dropped,
    and a form posted after the session ended to its action's URL, which answers POST only (405)."""
    asked = console.get("/jobs?state=dead&type=export", follow_redirects=False)
    assert asked.status_code == 303
    page = console.get(asked.headers["location"])
    nxt = re.search(r'name="next" value="([^"]+)"', page.text).group(1).replace("&amp;", "&")
    assert nxt == "/jobs?state=dead&type=export"
    token = csrf_of(page.text)
    done = console.post("/login", data={"name": "ada", "password": ADMIN_PW, "csrf": token, "next": nxt},
                        follow_redirects=False)
    assert done.headers["location"] == "/jobs?state=dead&type=export"
    job_id = dead_job(broker, {"customer_id": 1})
    console.cookies.clear()  # the session ended while the job's page was open: its Retry is posted
    posted = console.post(f"/jobs/{job_id}/retry", data={"csrf": token}, follow_redirects=False,
                          headers={"referer": f"http://testserver/jobs/{job_id}"})
    assert posted.status_code == 303
    back = console.get(posted.headers["location"])
    assert re.search(r'name="next" value="([^"]+)"', back.text).group(1) == f"/jobs/{job_id}"
    other = console.post(f"/jobs/{job_id}/retry", data={"csrf": token}, follow_redirects=False,
                         headers={"referer": "http://elsewhere.example/jobs"})
    assert other.headers["location"] == "/login?next=/"
    assert broker.get(job_id).state == "dead"


def test_failed_logins_from_one_address_are_throttled_without_locking_out_others(tmp_path, caplog):
    cfg = make_config(tmp_path, f"sqlite:///{tmp_path}/throttle.db")
    app = web_app.build(cfg, sample_interval=0.05)
    caplog.set_level(logging.INFO, logger="tangguh.web")
    with TestClient(app, client=("192.0.2.7", 40000)) as guesser:
        for i in range(throttle.FAILURES):
            assert login(guesser, "ada", f"guess-{i}").status_code == 401
        # The limit reached: refused before the password is even checked, the right one too.
        refused = login(guesser, "ada", ADMIN_PW)
        assert refused.status_code == 429
        assert "Too many failed logins" in refused.text
        assert 0 < int(refused.headers["retry-after"]) <= throttle.WINDOW
        assert guesser.get("/jobs", follow_redirects=False).headers["location"].startswith("/login")
        events = [r.action for r in caplog.records if getattr(r, "event", None) == "web_action"]
        assert events.count("login_refused") == throttle.FAILURES and events[-1] == "login_throttled"
        # Another address is not held up by the guesser.
        other = TestClient(app, client=("192.0.2.8", 40000))
        assert login(other, "ada", ADMIN_PW).status_code == 303


def test_the_login_throttle_forgets_after_its_window_and_stays_bounded():
    now = [1000.0]
    t = throttle.LoginThrottle(failures=3, window=60, max_addresses=100, clock=lambda: now[0])
    for _ in range(3):
        t.failed("a")
    assert t.wait("a") == 60
    now[0] += 59
    assert t.wait("a") == 1
    now[0] += 1
    assert t.wait("a") == 0 and "a" not in t.recent  # the window passed: forgotten, not kept
    for _ in range(3):
        t.failed("b")
    t.succeeded("b")
    assert t.wait("b") == 0
    for i in range(20_000):  # a crowd of addresses (or months of them): the table stays bounded
        t.failed(f"10.{i // 65536}.{i // 256 % 256}.{i % 256}")
    assert len(t.recent) == 100
    assert all(len(times) <= 3 for times in t.recent.values())


def test_a_viewer_sees_no_buttons_and_a_forged_post_is_refused(console, broker):
    job_id = dead_job(broker, {"n": 1})
    login(console, "vic", VIEWER_PW)
    for path in ("/jobs", f"/jobs/{job_id}", "/dead", "/queues", "/schedules"):
        main = console.get(path).text.split("</header>")[1]
        assert 'method="post"' not in main, path
        assert "<button" not in main.replace('<button class="primary" id="search-button">', ""), path
    token = csrf_of(console.get("/dead").text)
    refused = console.post("/dead/replay", data={"csrf": token, "ids": job_id})
    assert refused.status_code == 403
    assert console.post("/api/queues/default/pause", headers={"x-csrf-token": token}).status_code == 403
    assert broker.get(job_id).state == "dead"


def test_a_post_without_the_csrf_token_is_refused_and_with_it_the_action_runs_and_is_logged(console, broker, caplog):
    job_id = dead_job(broker, {"n": 1})
    login(console, "ada", ADMIN_PW)
    assert console.post("/dead/replay", data={"ids": job_id}).status_code == 403
    assert console.post("/dead/replay", data={"ids": job_id, "csrf": "forged"}).status_code == 403
    assert broker.get(job_id).state == "dead"
    token = csrf_of(console.get("/dead").text)
    with caplog.at_level(logging.INFO, logger="tangguh.web"):
        done = console.post("/dead/replay", data={"ids": job_id, "csrf": token}, follow_redirects=False)
    assert done.status_code == 303
    assert broker.get(job_id).state == "queued"
    (event,) = [r for r in caplog.records if getattr(r, "action", None) == "dlq_replay"]
    assert (event.user, event.count, event.job_ids) == ("ada", 1, [job_id])
    logged = json.loads(JsonFormatter().format(event))
    assert {logged["user"], logged["action"], logged["count"]} == {"ada", "dlq_replay", 1}


def test_a_replay_at_a_rate_audits_each_call_as_it_goes_and_frees_its_slot_after_the_last(console, broker, caplog):
    first, second, third, fourth = (dead_job(broker, {"n": n}) for n in range(4))
    login(console, "ada", ADMIN_PW)
    token = csrf_of(console.get("/dead").text)
    caplog.set_level(logging.INFO, logger="tangguh.web")

    def replay(rate, *ids):
        return console.post("/dead/replay", data={"csrf": token, "ids": list(ids), "rate": rate},
                            follow_redirects=False)

    for rate in ("1e-9", "0.001", "0", "nan", "inf"):  # one such replay would hold a slot for days
        refused = replay(rate, first)
        assert refused.status_code == 400 and "from 0.01" in refused.text, rate
    assert broker.get(first).state == "dead"

    def audited():
        return [r.job_ids for r in caplog.records if getattr(r, "action", None) == "dlq_replay"]

    # At 0.02/s the second job waits 50 s; the first one's audit line is written now, not then.
    assert replay("0.02", first, second).status_code == 303
    assert wait_for(audited, timeout=5, message="the first call's audit line") == [[first]]
    assert broker.get(first).state == "queued" and broker.get(second).state == "dead"
    # A replay's last call ends it: no pause after it holding one of the two slots.
    assert replay("0.02", third).status_code == 303
    wait_for(lambda: "by ada: 1 of 1 — finished" in console.get("/dead").text, timeout=5,
             message="the one-job replay to finish")
    assert replay("0.02", fourth).status_code == 303, "its slot is free again"
    wait_for(lambda: broker.get(fourth).state == "queued", timeout=5, message="the fourth job replayed")


def test_bearer_tokens_read_and_act_by_role_without_csrf(tmp_path, broker):
    admin_token, admin_digest = auth.new_token()
    viewer_token, viewer_digest = auth.new_token()
    cfg = make_config(tmp_path, broker.url, tokens={"deploy": {"sha256": admin_digest, "role": "admin"},
                                                     "grafana": {"sha256": viewer_digest, "role": "viewer"}})
    job_id = dead_job(broker, {"n": 1})
    with TestClient(web_app.build(cfg, sample_interval=0.05)) as client:
        def call(method, path, token, **kw):
            return client.request(method, path, headers={"authorization": f"Bearer {token}"}, **kw)

        assert call("GET", f"/api/jobs/{job_id}", viewer_token).json()["state"] == "dead"
        assert call("GET", "/api/dead", "wrong-token").status_code == 401
        assert call("POST", "/api/dead/replay", viewer_token, json={"ids": [job_id]}).status_code == 403
        assert broker.get(job_id).state == "dead"
        answer = call("POST", "/api/dead/replay", admin_token, json={"ids": [job_id]})
        assert answer.status_code == 200 and answer.json()["outcome"] == "1 replayed"
        assert broker.get(job_id).state == "queued"
        assert call("GET", "/api/jobs/job_nope", viewer_token).status_code == 404
        assert call("POST", "/api/dead/replay", admin_token, content=b"[").status_code == 400


def test_an_api_action_on_one_job_the_broker_does_not_hold_answers_404_naming_it(tmp_path, broker):
    """``POST /api/jobs/ID/cancel`` on an id that names no job answered 200 ``{"outcome": "unknown"}``
    while ``GET /api/jobs/ID`` answered 404: a script checking the status took it for done. Every
    single-job action answers 404 naming the id now; a bulk action still counts it as unknown."""
    token, digest = auth.new_token()
    cfg = make_config(tmp_path, broker.url, tokens={"deploy": {"sha256": digest, "role": "admin"}})
    job_id = dead_job(broker, {"n": 1})
    with TestClient(web_app.build(cfg, sample_interval=0.05)) as client:
        def post(path, **kw):
            return client.post(path, headers={"authorization": f"Bearer {token}"}, **kw)

        for action in ("cancel", "retry", "replay", "delete"):
            answer = post(f"/api/jobs/job_nope/{action}")
            assert (answer.status_code, answer.json()) == (404, {"error": "no job job_nope"}), action
        bulk = post("/api/jobs/cancel", json={"ids": ["job_nope"]})
        assert (bulk.status_code, bulk.json()["outcome"]) == (200, {"unknown": 1})
        answer = post(f"/api/jobs/{job_id}/retry")
        assert answer.status_code == 200 and answer.json()["outcome"] != "unknown", answer.text
        assert broker.get(job_id).state != "dead"


# -- what a browser is told ------------------------------------------------------------

def test_headers_forbid_inline_scripts_and_framing_and_the_cookie_is_httponly_and_samesite(console):
    page = console.get("/login")
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp and "frame-ancestors 'none'" in csp
    assert page.headers["x-frame-options"] == "DENY"
    cookie = page.headers["set-cookie"].lower()
    assert "httponly" in cookie and "samesite=strict" in cookie
    assert "<script>" not in page.text and " on" + "click=" not in page.text and "style=" not in page.text


def test_over_https_the_session_cookie_is_secure(tmp_path, broker, console):
    """Behind a TLS proxy the browser must never send the session over plain HTTP: the
    cookie carries ``Secure`` when the request came over HTTPS (uvicorn takes the scheme
    from ``X-Forwarded-Proto`` of a proxy on 127.0.0.1); on plain HTTP it cannot."""
    assert "secure" not in console.get("/login").headers["set-cookie"].lower()
    with TestClient(web_app.build(make_config(tmp_path, broker.url)), base_url="https://localhost") as tls:
        answer = login(tls, "ada", ADMIN_PW)
        cookies = [v.lower() for k, v in answer.headers.multi_items() if k == "set-cookie"]
        assert cookies and all("; secure" in c for c in cookies)
        assert tls.get("/jobs", follow_redirects=False).status_code == 200  # the cookie comes back over HTTPS


def test_a_redacted_field_never_appears_in_a_page_or_an_api_answer(console, broker):
    job_id = dead_job(broker, {"customer_id": 42, "card": {"card_number": SECRET}, "card_number": SECRET})
    login(console, "ada", ADMIN_PW)
    for path in (f"/jobs/{job_id}", "/dead", f"/api/jobs/{job_id}", "/api/dead", "/jobs"):
        answer = console.get(path)
        assert answer.status_code == 200, path
        # No part of the number either (a mask that keeps its first group); "4111" alone would also
        # match a timestamp, as every one of epoch 1796411100-1796411199 does.
        assert SECRET not in answer.text and "4111-" not in answer.text and "-1111" not in answer.text, path
    assert "***" in console.get(f"/jobs/{job_id}").text
    refused = console.get("/jobs", params={"where": f"card_number={SECRET}"})
    assert "is redacted and cannot be searched" in refused.text


# -- trouble ---------------------------------------------------------------------------

@pytest.mark.parametrize("job_id", ["order/42", "inv#7", "a?b=1", "50%"])
def test_a_job_whose_id_the_caller_chose_is_reached_from_its_links_and_acted_on(console, broker, job_id):
    """An id from NewJob(id=...) may hold any character: its links went to /jobs/inv (no job inv),
    /jobs/a (no job a) or, with a '/', to no route at all: the job could not be opened, retried or
    deleted from the console."""
    broker.enqueue(NewJob("export", {"customer_id": 1}, id=job_id).validate())
    (claimed,) = broker.claim(["default"], 1, 30, "test")
    broker.dead(claimed.lease, "exception", error_info("exception", "ValueError", "boom", "Traceback"))
    login(console, "ada", ADMIN_PW)
    listed = console.get("/jobs", params={"state": "dead"}).text
    href = re.search(r'<a href="([^"]+)" class="mono">' + re.escape(job_id.replace("&", "&amp;")), listed).group(1)
    page = console.get(href)
    assert page.status_code == 200 and f'data-job-id="{job_id}"' in page.text
    assert console.get(href.replace("/jobs/", "/api/jobs/")).json()["id"] == job_id
    action = re.search(r'<form method="post" action="([^"]+/retry)"', page.text).group(1)
    retried = console.post(action, data={"csrf": csrf_of(page.text)}, follow_redirects=False)
    assert retried.status_code == 303 and broker.get(job_id).state == "queued"
    assert f'data-job-id="{job_id}"' in console.get(retried.headers["location"]).text


def test_a_cancel_requested_by_nobody_in_particular_says_no_none(console, broker):
    """Client.cancel(ids) names no one: the job page said 'cancel requested by None' ('by null' live)."""
    job_id = broker.enqueue(NewJob("export", {"customer_id": 1}).validate())
    broker.claim(["default"], 1, 30, "test")
    assert broker.cancel([job_id], None, None) == {job_id: "requested"}
    login(console, "ada", ADMIN_PW)
    shown = re.search(r'<div id="job-cancel-request" class="muted">([^<]*)</div>', console.get(f"/jobs/{job_id}").text)
    assert shown.group(1) == "cancel requested"


def test_unknown_job_is_a_404_page_and_a_bad_filter_an_inline_error(console):
    login(console, "ada", ADMIN_PW)
    missing = console.get("/jobs/job_doesnotexist")
    assert missing.status_code == 404 and "no job job_doesnotexist" in missing.text
    assert console.get("/no/such/page").status_code == 404
    bad = console.get("/jobs", params={"state": "exploded", "since": "yesterday"})
    assert bad.status_code == 200 and 'id="filter-error"' in bad.text
    assert console.get("/jobs", params={"where": "a.=1"}).status_code == 200
    twice = console.get("/jobs", params={"where": "a=1\na=2"})  # the second value replaced the first
    assert 'id="filter-error"' in twice.text and "payload.a given twice" in twice.text
    assert console.get("/api/jobs", params={"where": "a=1\na=2"}).status_code == 400


def test_every_page_renders_with_a_banner_while_the_broker_is_down(tmp_path):
    cfg = make_config(tmp_path, "redis://127.0.0.1:1/0", users=False)
    with TestClient(web_app.build(cfg, sample_interval=0.05), base_url=LOOPBACK, client=HERE) as client:
        wait_for(lambda: client.get("/api/overview").json()["at"], message="the first sample")
        for path in ("/", "/jobs", "/dead", "/queues", "/schedules", "/supervisors"):
            page = client.get(path)
            assert page.status_code == 200, path
            assert "unreachable" in page.text, path
            assert "Connection refused. Figures" in page.text, path  # one full stop (it read "refused.. Figures")
            assert "Traceback" not in page.text
        assert client.get("/jobs/job_x").status_code == 503
        assert client.get("/api/queues").status_code == 503
        token = csrf_of(client.get("/queues").text)
        assert client.post("/queues/pause", data={"csrf": token, "queue": "default"}).status_code in (501, 503)


def test_a_job_pages_live_updates_say_when_the_broker_goes_away_and_comes_back(private_redis):
    """The job page's stream read nothing during an outage and said nothing: the page kept showing
    the last state and progress as current. It now sends the outage as a banner, cleared after it."""
    import asyncio
    import uuid

    from supervisor.backends.base import open_broker
    from supervisor.model import FINISHED
    from supervisor.web import live
    from supervisor.web.brokerio import BrokerPool
    from supervisor.web.console import pretty, when
    from supervisor.web.redact import Redactor

    url = f"{private_redis.url}?prefix=t{uuid.uuid4().hex[:10]}"
    broker = open_broker(url)
    job_id = broker.enqueue(NewJob("export", {"customer_id": 1}).validate())
    broker.close()

    class Open:  # the browser stays on the page
        async def is_disconnected(self):
            return False

    async def watch():
        pool = BrokerPool(url)
        stream = live.job_stream(Open(), pool, Redactor([]), job_id, FINISHED, when, pretty, interval=0.05)
        seen = []

        async def until(name, check=lambda data: True):
            while True:
                text = await asyncio.wait_for(stream.__anext__(), 30)
                kind, data = text.split("\n")[0][len("event: "):], json.loads(text.split("\n")[1][len("data: "):])
                seen.append(kind)
                if kind == name and check(data):
                    return data

        try:
            assert (await until("job"))["state"] == "queued"
            await asyncio.to_thread(private_redis.stop)
            down = await until("problems", lambda d: d["problems"])
            assert "unreachable" in down["problems"][0]
            await asyncio.to_thread(private_redis.start)
            assert await until("problems") == {"problems": []}
        finally:
            await stream.aclose()
            pool.close()
        return seen

    seen = asyncio.run(watch())
    assert "gone" not in seen and seen.count("job") == 1


def test_an_outage_keeps_the_overviews_last_figures_under_its_banner(private_redis):
    """The sampler replaced the queues and supervisors with nothing while the broker was unreachable:
    the overview's live update said 'No supervisor records.', as if every supervisor had gone."""
    import asyncio
    import uuid

    from supervisor.backends.base import open_broker
    from supervisor.web.brokerio import BrokerPool
    from supervisor.web.live import Sampler

    url = f"{private_redis.url}?prefix=t{uuid.uuid4().hex[:10]}"
    broker = open_broker(url)
    broker.enqueue(NewJob("export", {"customer_id": 1}).validate())
    broker.write_supervisor({"id": "host-a:1", "host": "host-a", "pid": 1, "queues": ["default"]}, ttl=30)
    broker.close()

    async def outage():
        pool = BrokerPool(url)
        sampler = Sampler(pool, ["default"], interval=0.05)
        try:
            before = await sampler.sample()
            await asyncio.to_thread(private_redis.stop)
            during = await sampler.sample()
        finally:
            await asyncio.to_thread(private_redis.start)
            pool.close()
        return before, during

    before, during = asyncio.run(outage())
    assert before["problems"] == [] and [(q["queue"], q["ready"]) for q in before["queues"]] == [("default", 1)]
    assert [r["host"] for r in before["supervisors"]] == ["host-a"]
    assert "unreachable" in during["problems"][0]
    assert during["queues"] == before["queues"] and during["supervisors"] == before["supervisors"]


def test_an_unexpected_error_is_a_page_without_a_traceback(tmp_path, monkeypatch):
    from supervisor.web import pages

    def explode(*a, **kw):
        raise RuntimeError("secret internals")

    monkeypatch.setattr(pages, "schedule_listing", explode)
    cfg = make_config(tmp_path, f"sqlite:///{tmp_path}/b.db", users=False)
    with TestClient(web_app.build(cfg), raise_server_exceptions=False, base_url=LOOPBACK, client=HERE) as client:
        page = client.get("/schedules")
        assert page.status_code == 500
        assert "secret internals" not in page.text and "Traceback" not in page.text
        # Answered outside the middleware, yet with every header the others carry.
        assert page.headers["x-frame-options"] == "DENY" and "frame-ancestors 'none'" in page.headers[
            "content-security-policy"] and page.headers["cache-control"] == "no-store"
        assert client.get("/api/schedules").json() == {"error": "internal error (the console's log has the details)"}


def test_a_bulk_action_on_a_filter_shows_the_count_first_then_acts_and_logs_the_filter(console, broker, caplog):
    mine = [broker.enqueue(NewJob("export", {"customer": {"id": 7}}, delay=3600).validate()) for _ in range(3)]
    other = broker.enqueue(NewJob("export", {"customer": {"id": 8}}, delay=3600).validate())
    login(console, "ada", ADMIN_PW)
    token = csrf_of(console.get("/jobs").text)
    form = {"csrf": token, "action": "cancel", "scope": "filter", "where": "customer.id=7"}
    confirm = console.post("/jobs/bulk", data=form)
    assert confirm.status_code == 200
    assert re.search(r'id="confirm-count">3<', confirm.text)
    assert {broker.get(i).state for i in mine + [other]} == {"queued"}  # nothing changed before the confirmation
    with caplog.at_level(logging.INFO, logger="tangguh.web"):
        done = console.post("/jobs/bulk", data={**form, "confirmed": "yes"}, follow_redirects=False)
    assert done.status_code == 303
    assert [broker.get(i).state for i in mine] == ["cancelled"] * 3 and broker.get(other).state == "queued"
    (event,) = [r for r in caplog.records if getattr(r, "action", None) == "cancel"]
    assert event.count == 3 and event.filter == {"payload": {"customer.id": 7}} and sorted(event.job_ids) == sorted(mine)
    assert "3 cancelled" in console.get("/jobs").text
    everything = console.post("/jobs/bulk", data={"csrf": token, "action": "discard", "scope": "filter"})
    assert everything.status_code == 400 and "narrow it first" in everything.text


def test_job_queue_and_schedule_actions_from_the_pages(tmp_path, broker):
    cfg = make_config(tmp_path, broker.url)
    cfg.schedules = config.from_dict({"schedules": {"nightly": {"cron": "0 3 * * *", "type": "export",
                                                               "payload": {"customer_id": 1}}}}, str(tmp_path)).schedules
    job_id = broker.enqueue(NewJob("export", {"n": 1}, delay=3600).validate())
    with TestClient(web_app.build(cfg, sample_interval=0.05)) as client:
        login(client, "ada", ADMIN_PW)
        token = csrf_of(client.get(f"/jobs/{job_id}").text)

        def post(path, **form):
            return client.post(path, data={"csrf": token, **form}, follow_redirects=False)

        copy = post(f"/jobs/{job_id}/replay").headers["location"].rsplit("/", 1)[1]
        assert copy != job_id and broker.get(copy).payload == {"n": 1}
        assert post(f"/jobs/{job_id}/cancel").status_code == 303 and broker.get(job_id).state == "cancelled"
        assert post(f"/jobs/{job_id}/retry").status_code == 303 and broker.get(job_id).state == "queued"
        assert post(f"/jobs/{job_id}/delete").headers["location"] == "/jobs" and broker.get(job_id) is None
        assert post(f"/jobs/{copy}/explode").status_code == 400
        assert post("/queues/pause", queue="default").status_code == 303 and "default" in broker.paused()
        assert post("/queues/resume").status_code == 303 and broker.paused() == {}
        assert post("/queues/pause", queue="no such queue!").status_code == 400 and broker.paused() == {}
        run = post("/schedules/nightly/run").headers["location"].rsplit("/", 1)[1]
        assert broker.get(run).type == "export" and broker.get(run).payload == {"customer_id": 1}
        assert post("/schedules/nope/run").status_code == 400


def test_a_bounded_search_says_so_and_the_next_page_searches_further(console, broker):
    # A payload field is checked job by job on SQLite and Redis (PostgreSQL has an index): with
    # more non-matching jobs newer than the match than one page may check, the first page is
    # short. It must say so, not "No job matches", and its next page must go on to find the job.
    from supervisor.backends import scan

    login(console, "ada", ADMIN_PW)
    mine = broker.enqueue(NewJob("export", {"customer_id": 42}).validate())
    broker.enqueue_many([NewJob("export", {"customer_id": 1}) for _ in range(scan.SCAN_BOUND + 100)])
    page = console.get("/jobs", params={"where": "customer_id=42"})
    if not broker.url.startswith("postgresql"):
        assert 'id="partial-search"' in page.text and "No job matches" not in page.text
        assert mine not in page.text and "Search further" in page.text
    for _ in range(5):
        if mine in page.text:
            break
        link = re.search(r'href="([^"]+)" class="button" id="next-page"', page.text).group(1)
        page = console.get(link.replace("&amp;", "&"))
    assert mine in page.text and 'id="partial-search"' not in page.text


# -- hostile requests --------------------------------------------------------------------

def test_an_open_console_answers_loopback_hosts_only_so_a_rebound_dns_name_reaches_nothing(tmp_path, broker):
    """With no users every request acts as an admin. A page whose DNS name an attacker points
    at 127.0.0.1 is the console's own origin in the victim's browser; its requests still name
    the attacker's host, and that is what turns them away: no page, no token, no action."""
    cfg = make_config(tmp_path, broker.url, users=False)

    def open_console(base):
        return TestClient(web_app.build(cfg, sample_interval=0.05), base_url=base, client=HERE)

    with open_console("http://attacker.example:9465") as rebound:
        for answer in (rebound.get("/jobs"), rebound.get("/api/queues"),
                       rebound.post("/api/queues/default/pause", json={})):
            assert answer.status_code == 400 and "loopback address only" in answer.text
            assert answer.headers["x-frame-options"] == "DENY"
    assert broker.paused() == {}
    for base in (LOOPBACK, "http://localhost:9465", "http://[::1]:9465", "http://127.0.0.2"):
        with open_console(base) as local:
            assert local.get("/api/queues").status_code == 200, base
    # With users, the session cookie never goes to another host name: no such rule, and none needed.
    with TestClient(web_app.build(make_config(tmp_path, broker.url)), base_url="http://console.internal") as named:
        assert login(named, "ada", ADMIN_PW).status_code == 303


def test_an_open_console_serves_no_remote_client_even_through_a_proxy_on_this_machine(tmp_path, broker):
    """A reverse proxy on this machine forwards remote clients from 127.0.0.1, their Host passed
    through: a remote client sending `Host: localhost` must not become the anonymous admin."""
    from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

    cfg = make_config(tmp_path, broker.url, users=False)
    # As `serve` runs it: uvicorn takes the client address from X-Forwarded-For sent by 127.0.0.1.
    proxied = ProxyHeadersMiddleware(web_app.build(cfg, sample_interval=0.05), trusted_hosts="127.0.0.1")
    with TestClient(proxied, base_url="http://localhost:9465", client=HERE) as via_proxy:
        for name, value in (("X-Forwarded-For", "192.0.2.2"), ("Forwarded", "for=192.0.2.2"),
                            ("X-Real-IP", "192.0.2.2"), ("X-Forwarded-Host", "console.example.com")):
            for answer in (via_proxy.get("/queues", headers={name: value}),
                           via_proxy.post("/api/queues/default/pause", json={}, headers={name: value})):
                assert answer.status_code == 403, name
                assert answer.text.count("\n") == 1 and "through a proxy" in answer.text and name.lower() in answer.text
        assert via_proxy.get("/api/queues").status_code == 200  # this machine, no proxy: served
    # Whatever told the console the client's address, a remote one is refused.
    with TestClient(web_app.build(cfg, sample_interval=0.05), base_url="http://localhost:9465",
                    client=("192.0.2.2", 40000)) as remote:
        for answer in (remote.get("/queues"), remote.post("/api/queues/default/pause", json={})):
            assert answer.status_code == 403 and "clients on this machine only" in answer.text
    assert broker.paused() == {}


def test_the_form_routes_take_a_small_urlencoded_form_of_strings_only(tmp_path, broker):
    from supervisor.web.formbody import FORM_LIMIT, URLENCODED

    admin_token, digest = auth.new_token()
    cfg = make_config(tmp_path, broker.url, tokens={"deploy": {"sha256": digest, "role": "admin"}})
    job_id = dead_job(broker, {"n": 1})
    bearer = {"authorization": f"Bearer {admin_token}"}
    with TestClient(web_app.build(cfg, sample_interval=0.05)) as client:
        for path in ("/queues/pause", "/jobs/bulk", "/dead/replay", "/dead/purge"):  # JSON goes to /api/
            answer = client.post(path, json={"queue": "default", "ids": [job_id]}, headers=bearer)
            assert answer.status_code == 415 and URLENCODED in answer.text, path
        for path, data, files in (("/dead/replay", {"ids": job_id}, {"rate": ("r", b"1")}),
                                  ("/jobs/bulk", {"action": "cancel"}, {"ids": ("i", job_id.encode())})):
            assert client.post(path, data=data, files=files, headers=bearer).status_code == 415, path
        too_big = b"queue=" + b"a" * FORM_LIMIT
        assert client.post("/queues/pause", content=too_big, headers={**bearer, "content-type": URLENCODED}
                           ).status_code == 413
        assert client.post("/queues/pause", content=b"queue=%ff", headers={**bearer, "content-type": URLENCODED}
                           ).status_code == 400
        assert broker.get(job_id).state == "dead" and broker.paused() == {}
        # Before anyone has logged in: no file, and no body past 64 KiB, whether declared or chunked.
        token = csrf_of(client.get("/login").text)
        as_file = client.post("/login", data={"csrf": token, "name": "ada"},
                              files={"password": ("p", ADMIN_PW.encode())})
        assert as_file.status_code == 415 and "Log in" in as_file.text
        assert client.post("/login", content=b"name=" + b"a" * 70_000, headers={"content-type": URLENCODED}
                           ).status_code == 413
        chunked = client.post("/login", content=iter([b"name="] + [b"a" * 1024] * 70),
                              headers={"content-type": URLENCODED})
        assert chunked.status_code == 413
        assert client.post("/logout", files={"csrf": ("c", b"x")}).status_code == 415
        # What the pages post still works.
        assert client.post("/queues/pause", data={"queue": "default"}, headers=bearer,
                           follow_redirects=False).status_code == 303 and "default" in broker.paused()
        assert login(client, "ada", ADMIN_PW).status_code == 303


def test_a_viewer_never_sees_a_redacted_field_of_a_parents_result(console, broker):
    parent = broker.enqueue(NewJob("charge", {"n": 1}).validate())
    child = broker.enqueue(NewJob("receipt", {"n": 2}, depends_on=[(parent, "complete")]).validate())
    (claimed,) = broker.claim(["default"], 1, 30, "test")
    broker.ack(claimed.lease, {"card_number": SECRET, "auth_code": "A1"})
    login(console, "vic", VIEWER_PW)
    for path in (f"/api/jobs/{child}", f"/api/jobs/{parent}", f"/jobs/{child}"):
        answer = console.get(path)
        assert answer.status_code == 200 and SECRET not in answer.text, path
    assert console.get(f"/api/jobs/{child}").json()["parents"][parent][1] == {"card_number": "***", "auth_code": "A1"}


@pytest.mark.parametrize("how", ["cursor", "form body", "state", "payload", "payload pairs"])
def test_bad_input_to_the_api_is_a_400_not_an_error(console, how):
    login(console, "ada", ADMIN_PW)
    token = csrf_of(console.get("/jobs").text)
    if how == "cursor":  # JSON nested too deep to decode
        answer = console.get("/api/jobs", params={"cursor": base64.urlsafe_b64encode(b"[" * 20000).decode()})
    elif how == "form body":
        answer = console.post("/api/jobs/cancel", data={"filter": "x"}, headers={"x-csrf-token": token})
    else:
        bad = {"state": {"state": 5}, "payload": {"payload": 5}, "payload pairs": {"payload": [[1]]}}[how]
        answer = console.post("/api/jobs/cancel", json={"filter": bad, "dry_run": True},
                              headers={"x-csrf-token": token})
    assert answer.status_code == 400, answer.text
    assert "internal error" not in answer.text


def test_a_filter_action_dry_run_names_a_retrys_refusals_and_refuses_an_unknown_action(console, broker):
    """The count is what the filter selects; a retry of those may refuse some (parent_failed,
    conflict), as the CLI's dry run says. An action name no action has counted all the same."""
    dead_job(broker, {"n": 1})
    login(console, "ada", ADMIN_PW)
    token = csrf_of(console.get("/jobs").text)
    ask = {"filter": {"state": ["dead"]}, "dry_run": True}
    retry = console.post("/api/jobs/retry", json=ask, headers={"x-csrf-token": token})
    assert retry.status_code == 200 and retry.json() == {"dry_run": True, "count": 1, "exact": True,
                                                         "may_refuse": ["parent_failed", "conflict"]}
    discard = console.post("/api/jobs/discard", json=ask, headers={"x-csrf-token": token})
    assert discard.json() == {"dry_run": True, "count": 1, "exact": True}
    bogus = console.post("/api/jobs/explode", json=ask, headers={"x-csrf-token": token})
    assert bogus.status_code == 400 and "action must be one of" in bogus.text


def test_a_filter_action_counts_and_walks_only_the_jobs_it_changes(console, broker):
    """A filter without a state (type=export) counted every job it selects, done and dead too:
    "cancel: 3 jobs" for one queued job, the rest answered already_dead. And the capped run walked
    them all: with more finished jobs than the cap, the queued ones after them were never reached,
    whatever the number of runs."""
    from supervisor.web.actions import act_on_filter
    from supervisor.jobfilter import JobFilter

    dead_job(broker, {"n": 1})
    dead_job(broker, {"n": 2})
    queued = broker.enqueue(NewJob("export", {"n": 3}).validate())
    login(console, "ada", ADMIN_PW)
    token = csrf_of(console.get("/jobs").text)
    ask = {"filter": {"type": "export"}, "dry_run": True}
    cancel = console.post("/api/jobs/cancel", json=ask, headers={"x-csrf-token": token})
    assert cancel.json() == {"dry_run": True, "count": 1, "exact": True}
    retry = console.post("/api/jobs/retry", json=ask, headers={"x-csrf-token": token})
    assert retry.json()["count"] == 2
    page = console.post("/jobs/bulk", data={"csrf": token, "action": "cancel", "scope": "filter", "type": "export"})
    assert 'id="confirm-count">1<' in page.text, page.text
    assert act_on_filter(broker, "cancel", JobFilter(type="export"), "test", cap=2) == ({queued: "cancelled"}, False)
    assert act_on_filter(broker, "cancel", JobFilter(state=("done",)), "test") == ({}, False)  # no state it changes


def test_the_jobs_filter_offers_scheduled_as_the_overview_counts_it(console, broker):
    """The overview and the queues page show a Scheduled column; the Jobs filter had no such state."""
    due = broker.enqueue(NewJob("export", {"n": 1}).validate())
    later = broker.enqueue(NewJob("export", {"n": 2}, delay=3600).validate())
    login(console, "ada", ADMIN_PW)
    page = console.get("/jobs", params={"state": "scheduled"})
    assert page.status_code == 200 and '<input type="checkbox" name="state" value="scheduled" checked>' in page.text
    assert later in page.text and due not in page.text
    assert [j["id"] for j in console.get("/api/jobs", params={"state": "scheduled"}).json()["jobs"]] == [later]


def test_a_logout_ends_the_session_even_for_a_copy_of_its_cookie(console):
    """The session cookie is signed, not stored: a copy taken before the logout (a shared
    machine, a stolen cookie) must not read pages or act for the rest of its twelve hours."""
    assert login(console, "ada", ADMIN_PW).status_code == 303
    token = csrf_of(console.get("/jobs").text)
    kept = console.cookies.get("tangguh_web")
    assert console.get("/api/supervisors").status_code == 200
    assert console.post("/logout", data={"csrf": token}, follow_redirects=False).status_code == 303
    console.cookies.set("tangguh_web", kept)  # the copy, put back
    assert console.get("/api/supervisors").status_code == 401
    assert console.post("/api/queues/default/pause", json={}, headers={"x-csrf-token": token}).status_code in (401, 403)
    assert console.get("/jobs", follow_redirects=False).status_code in (302, 303, 307)  # to the login page
    assert login(console, "ada", ADMIN_PW).status_code == 303  # a new login is a new session
    assert console.get("/api/supervisors").status_code == 200


def test_a_live_stream_ends_with_the_session_that_opened_it(tmp_path):
    """The gate checked the session once, when the stream opened: after a logout (or twelve hours)
    a page left open, or a copy of the cookie, kept receiving every queue and supervisor for as
    long as it stayed connected. The stream now ends with its session."""
    import subprocess
    import sys
    import time

    import httpx

    from .daemon import daemon_env
    from .servers import free_port

    port = free_port()
    cfg = tmp_path / "t.toml"
    cfg.write_text(f'[broker]\nurl = "sqlite:///{tmp_path}/b.db"\n'
                   f'[web.users.ada]\npassword = "{hashed(ADMIN_PW)}"\nrole = "admin"\n')
    proc = subprocess.Popen([sys.executable, "-m", "supervisor.cli", "web", "-c", str(cfg), "--listen",
                             f"127.0.0.1:{port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=daemon_env())

    def up():
        try:
            return httpx.get(f"http://127.0.0.1:{port}/login", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False
    try:
        wait_for(up, timeout=30, message="the console up")
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as browser:
            assert login(browser, "ada", ADMIN_PW).status_code == 303
            token = csrf_of(browser.get("/").text)
            with browser.stream("GET", "/events/overview") as stream:
                lines = stream.iter_lines()
                assert next(line for line in lines if line.startswith("event:")) == "event: overview"
                assert browser.post("/logout", data={"csrf": token}).status_code == 303
                after, deadline = 0, time.monotonic() + 20
                for line in lines:  # until the console ends the stream
                    after += line.startswith("event:")
                    assert time.monotonic() < deadline, f"{after} events sent after the logout, and more coming"
            assert after <= 1  # one may have been on its way
    finally:
        proc.terminate()
        proc.wait(10)


def test_the_live_sessions_stay_bounded_and_forget_expired_ones():
    sessions = auth.Sessions(max_age=3600, most=3)
    first, *rest = [sessions.start() for _ in range(4)]
    assert not sessions.live(first) and all(sessions.live(s) for s in rest) and len(sessions.until) == 3
    sessions.end(rest[0])
    assert not sessions.live(rest[0]) and not sessions.live(None) and not sessions.live(["x"])
    brief = auth.Sessions(max_age=0.0)
    gone = brief.start()
    assert not brief.live(gone)
    brief.start()
    assert gone not in brief.until  # expired ones leave at the next login


def test_a_password_check_never_holds_up_the_other_requests(tmp_path, broker, monkeypatch):
    """argon2 is slow on purpose; checked on the event loop, each login attempt (anyone may
    make them) would stall every page, API answer and live stream of everyone else."""
    import threading

    checking, release, answers = threading.Event(), threading.Event(), []
    real = auth.check_password

    def held(*args):
        checking.set()
        release.wait(15)  # bounded: on the loop, this would hold the request below until then
        return real(*args)

    monkeypatch.setattr(auth, "check_password", held)
    with TestClient(web_app.build(make_config(tmp_path, broker.url), sample_interval=0.05)) as client:
        token = csrf_of(client.get("/login").text)
        form = {"name": "ada", "password": ADMIN_PW, "csrf": token, "next": "/"}
        worker = threading.Thread(target=lambda: answers.append(client.post("/login", data=form,
                                                                            follow_redirects=False)))
        worker.start()
        try:
            assert checking.wait(15), "the login's check did not start"
            assert client.get("/static/console.css").status_code == 200
            assert not release.is_set() and not answers  # served while the check was still running
        finally:
            release.set()
            worker.join(30)
        assert answers[0].status_code == 303


def test_new_token_prints_a_block_that_pasted_into_the_config_admits_the_token(tmp_path):
    result = tangguh("web", "new-token")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    token = lines[0].rsplit(" ", 1)[1]
    block = "\n".join(lines[2:]).replace("NAME", "deploy-script")
    cfg = config.from_dict(tomllib.loads('[web]\nlisten = "127.0.0.1:9465"\n' + block), str(tmp_path))
    assert cfg.web.tokens["deploy-script"]["role"] == "viewer"
    assert cfg.web.tokens["deploy-script"]["sha256"] == hashlib.sha256(token.encode()).hexdigest()


def _other_address():
    """An address of this machine that is not loopback: its connections count as another machine's."""
    import ipaddress

    import psutil

    for addresses in psutil.net_if_addrs().values():
        for a in addresses:
            if a.family.name == "AF_INET" and not ipaddress.ip_address(a.address).is_loopback:
                return a.address
    return None


def test_idle_and_slow_connections_do_not_hold_the_console_and_one_machine_holds_its_share(tmp_path):
    """200 sockets that sent nothing took every one of uvicorn's connection slots for as long
    as they stayed open: every request, the login page's too, was a 503. A connection whose
    request head is not complete within HEAD_SECONDS is closed now, and one machine holds at
    most PER_PEER connections."""
    import socket
    import subprocess
    import sys
    import urllib.error
    import urllib.request

    from supervisor.web.connections import PER_PEER

    from .daemon import daemon_env
    from .servers import free_port

    port = free_port()
    cfg = tmp_path / "t.toml"
    cfg.write_text(f'[broker]\nurl = "sqlite:///{tmp_path}/b.db"\n'
                   f'[web.users.ada]\npassword = "{hashed(ADMIN_PW)}"\nrole = "admin"\n')
    proc = subprocess.Popen([sys.executable, "-m", "supervisor.cli", "web", "-c", str(cfg), "--listen",
                             f"0.0.0.0:{port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=daemon_env())
    held = []

    def login_page():
        try:
            return urllib.request.urlopen(f"http://127.0.0.1:{port}/login", timeout=5).status
        except urllib.error.HTTPError as exc:
            return exc.code
        except OSError:
            return None
    try:
        wait_for(lambda: login_page() == 200, timeout=30, message="the console up")
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(web_app.MAX_CONNECTIONS)]
        slow = socket.create_connection(("127.0.0.1", port))
        slow.sendall(b"GET /login HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # and never the rest of its head
        held.append(slow)
        wait_for(lambda: login_page() == 200, timeout=30, message="the console serving past the idle sockets")
        slow.settimeout(30)
        assert slow.recv(1024) == b""  # closed, no answer
        # A first request answered, then the next head a byte at a time: that byte cancelled
        # uvicorn's keep-alive wait, and nothing bounded the rest.
        again = socket.create_connection(("127.0.0.1", port))
        held.append(again)
        again.settimeout(30)
        again.sendall(b"GET /login HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        answer = b""
        while b"</html>" not in answer.lower():
            answer += again.recv(65536)
        again.sendall(b"G")
        while again.recv(65536):  # closed, never answered
            pass
        other = _other_address()
        assert other is not None, "this test needs an address of this machine that is not loopback"
        mine = [socket.create_connection((other, port)) for _ in range(PER_PEER + 4)]
        held += mine
        answered = 0
        for s in mine:
            s.settimeout(10)
            try:
                s.sendall(b"GET /login HTTP/1.1\r\nHost: console\r\n\r\n")
                answered += s.recv(64).startswith(b"HTTP/1.1 200")
            except OSError:  # reset: refused at once
                pass
        assert answered == PER_PEER
    finally:
        for s in held:
            s.close()
        proc.terminate()
        proc.wait(10)


@pytest.mark.parametrize("behind_proxy", [True, False])
def test_the_login_throttle_counts_a_forwarded_address_only_behind_a_proxy(tmp_path, behind_proxy):
    """A console with no proxy in front trusted X-Forwarded-For from 127.0.0.1 all the same:
    a local process guessing passwords named a new address for each guess and was never held
    off. With ``behind_proxy = false`` the throttle counts the connection's own address."""
    import subprocess
    import sys

    import httpx

    from .daemon import daemon_env
    from .servers import free_port

    port = free_port()
    cfg = tmp_path / "t.toml"
    cfg.write_text(f'[broker]\nurl = "sqlite:///{tmp_path}/b.db"\n[web]\nbehind_proxy = {str(behind_proxy).lower()}\n'
                   f'[web.users.ada]\npassword = "{hashed(ADMIN_PW)}"\nrole = "admin"\n')
    proc = subprocess.Popen([sys.executable, "-m", "supervisor.cli", "web", "-c", str(cfg), "--listen",
                             f"127.0.0.1:{port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=daemon_env())
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as guesser:
            def up():
                try:
                    return guesser.get("/login").status_code == 200
                except httpx.TransportError:
                    return False
            wait_for(up, timeout=30, message="the console up")
            answers = []
            for i in range(throttle.FAILURES + 1):
                token = csrf_of(guesser.get("/login").text)
                answers.append(guesser.post("/login", data={"name": "ada", "password": f"guess-{i}", "csrf": token},
                                            headers={"X-Forwarded-For": f"192.0.2.{i + 1}"}).status_code)
        assert answers[:throttle.FAILURES] == [401] * throttle.FAILURES
        # Behind a proxy each forwarded address is a browser of its own; without one, one guesser.
        assert answers[-1] == (401 if behind_proxy else 429)
    finally:
        proc.terminate()
        proc.wait(10)


def test_the_api_reads_a_capped_body_as_json_only(tmp_path, broker):
    """A form or multipart body posted to /api/ went through Starlette's parser (an upload of
    any size spooled to disk) before the endpoint refused it, and a JSON body of any size was
    read whole. The API now reads up to FORM_LIMIT of any body, then parses it as JSON."""
    from supervisor.web.formbody import FORM_LIMIT

    admin_token, digest = auth.new_token()
    cfg = make_config(tmp_path, broker.url, tokens={"deploy": {"sha256": digest, "role": "admin"}})
    job_id = dead_job(broker, {"n": 1})
    bearer = {"authorization": f"Bearer {admin_token}"}
    with TestClient(web_app.build(cfg, sample_interval=0.05)) as client:
        upload = client.post("/api/jobs/cancel", files={"ids": ("ids", b"x" * (FORM_LIMIT + 1))}, headers=bearer)
        assert upload.status_code == 413 and "over 1024 KiB" in upload.json()["error"]
        form = client.post("/api/jobs/cancel", data={"ids": job_id}, headers=bearer)
        assert form.status_code == 400 and "JSON object" in form.json()["error"]
        big = b'{"ids": ["' + b"a" * FORM_LIMIT + b'"]}'
        declared = client.post("/api/dead/replay", content=big, headers={**bearer, "content-type": "application/json"})
        chunked = client.post("/api/dead/replay", content=iter([big[:1000], big[1000:]]),
                              headers={**bearer, "content-type": "application/json"})
        assert declared.status_code == chunked.status_code == 413
        assert broker.get(job_id).state == "dead"
        # A small JSON body (with any Content-Type, as `curl -d` sends it), and a change that needs
        # no body at all, are served as before.
        assert client.post("/api/queues/default/pause", headers=bearer).status_code == 200
        replayed = client.post("/api/dead/replay", content=json.dumps({"ids": [job_id]}),
                               headers={**bearer, "content-type": "application/x-www-form-urlencoded"})
        assert replayed.status_code == 200, replayed.text
    assert broker.get(job_id).state == "queued" and "default" in broker.paused()


def test_run_now_works_for_a_schedule_whose_name_holds_url_characters(tmp_path, broker):
    """The run button's form posted to ``/schedules/<name>/run`` with the name as it is: a
    schedule named ``reports/daily``, ``a?b``, ``50%`` or ``x#1`` (any TOML key is a schedule
    name) was not found (404) or ran nothing. The name is now percent-encoded in the link."""
    import html

    cfg = make_config(tmp_path, broker.url)
    names = ["reports/daily", "a?b", "50%", "x#1", "sp ace"]
    cfg.schedules = config.from_dict({"schedules": {n: {"cron": "0 3 * * *", "type": "export", "payload": {"n": n}}
                                                    for n in names}}, str(tmp_path)).schedules
    with TestClient(web_app.build(cfg, sample_interval=0.05)) as client:
        login(client, "ada", ADMIN_PW)
        page = client.get("/schedules").text
        token = csrf_of(page)
        actions = [html.unescape(a) for a in re.findall(r'<form method="post" action="([^"]*)"', page)
                   if "/schedules/" in a]
        assert len(actions) == len(names)
        for action in actions:
            done = client.post(action, data={"csrf": token}, follow_redirects=False)
            assert done.status_code == 303, (action, done.status_code)
    payloads = sorted(j.payload["n"] for j in broker.search({}, limit=100).jobs)
    assert payloads == sorted(names)
