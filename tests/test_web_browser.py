"""The web console in a real browser: headless Chromium driven by selenium, against a real
``tangguh web`` process, a real supervisor and a real broker (SQLite, Redis and PostgreSQL).

Each broker gets one stack for the module (a supervisor, a console, a browser
logged in as the admin); each test leaves the queues running. Pages are
screenshotted as they are tested; with ``TANGGUH_RECORD_SCREENSHOTS=1`` the
SQLite run's screenshots replace those in docs/console/.

Needs Debian's ``chromium`` and ``chromium-driver`` (CI installs them); without
them the module is skipped (a failure under ``TANGGUH_REQUIRE_SERVICES=1``).
"""
import os
import pathlib
import socket
import subprocess
import sys
import urllib.request
import uuid

import pytest

from supervisor import config
from supervisor.web import auth

from .conftest import POSTGRES_URL, REDIS_URL, REQUIRE_SERVICES, _unavailable, _with_query
from .daemon import Daemon, daemon_env
from .servers import free_port
from .util import wait_for

CHROMEDRIVER, CHROMIUM = "/usr/bin/chromedriver", "/usr/bin/chromium"
SECRET = "4111-1111-1111-1111"
ADMIN_PW, VIEWER_PW = "admin-password", "viewer-password"
DOCS = pathlib.Path(__file__).parent.parent / "docs" / "console"

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.common.exceptions import (NoSuchElementException, StaleElementReferenceException,  # noqa: E402
                                        WebDriverException)
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402

if not (os.path.exists(CHROMEDRIVER) and os.path.exists(CHROMIUM)):
    if REQUIRE_SERVICES:
        raise RuntimeError("TANGGUH_REQUIRE_SERVICES=1 but chromium/chromium-driver are not installed")
    pytest.skip("needs Debian's chromium and chromium-driver", allow_module_level=True)


class Console:
    """A real ``tangguh web`` process on the daemon's config."""

    def __init__(self, daemon):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(daemon.dir, "web.log")
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "supervisor.cli", "web", "-c", daemon.config_path,
                                      "--listen", f"127.0.0.1:{self.port}"], stdout=self.log,
                                     stderr=subprocess.STDOUT, env=daemon_env())
        wait_for(self.up, timeout=30, message="the console to answer")

    def up(self):
        assert self.proc.poll() is None, open(self.log_path).read()
        try:
            return urllib.request.urlopen(self.url + "/login", timeout=2).status == 200
        except OSError:
            return False

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def _replaced(exc):
    """None when chromium lost the node to a live update between finding and reading it (it says
    so as an inspector error, not as a stale element); any other driver error stands."""
    if "does not belong to the document" in str(exc):
        return None
    raise exc


class Stack:
    def __init__(self, name, daemon, console, driver, shots):
        self.name, self.daemon, self.console, self.driver, self.shots = name, daemon, console, driver, shots
        self.broker = daemon.broker

    def open(self, path):
        self.driver.get(self.console.url + path)

    def find(self, css):
        return self.driver.find_element(By.CSS_SELECTOR, css)

    def text(self, css):
        try:
            return self.find(css).text
        except (NoSuchElementException, StaleElementReferenceException):  # not there, or replaced by a live update
            return None
        except WebDriverException as exc:
            return _replaced(exc)

    def links(self, css):
        try:
            return [a.text for a in self.driver.find_elements(By.CSS_SELECTOR, css)]
        except StaleElementReferenceException:
            return None
        except WebDriverException as exc:
            return _replaced(exc)

    def login(self, name, password):
        self.driver.delete_all_cookies()
        self.open("/login")
        self.find("#name").send_keys(name)
        self.find("#password").send_keys(password)
        self.find("#login-button").click()
        wait_for(lambda: name in (self.text(".who") or ""), timeout=10, message=f"{name} to be logged in")

    def shot(self, name):
        self.driver.save_screenshot(str(self.shots / f"{name}.png"))

    def mark_page(self):
        """Tag the loaded document: the tag survives live updates and is lost on a reload."""
        self.driver.execute_script("window.__tangguh_test_mark = 1;")

    def same_page(self):
        return self.driver.execute_script("return window.__tangguh_test_mark === 1;")

    def post(self, path, fields):
        """A form POST sent by the page's own script (cookies included): the status code."""
        return self.driver.execute_async_script(
            "const done = arguments[arguments.length - 1];"
            "fetch(arguments[0], {method: 'POST', body: new URLSearchParams(arguments[1]), redirect: 'manual'})"
            ".then(r => done(r.status)).catch(e => done(String(e)));", path, fields)

    def browser_errors(self):
        return [e for e in self.driver.get_log("browser") if e["level"] == "SEVERE"]


@pytest.fixture(scope="module")
def driver():
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000",
                "--disable-gpu"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    d = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    d.set_script_timeout(10)
    yield d
    d.quit()


@pytest.fixture(scope="module", params=["sqlite", "redis", "postgres"])
def stack(request, driver, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"web-{request.param}")
    schema = prefix = None
    url = None
    if request.param == "redis":
        import redis

        try:
            redis.Redis.from_url(REDIS_URL, socket_connect_timeout=5).ping()
        except Exception as exc:  # noqa: BLE001
            _unavailable("redis", exc)
        prefix = f"tangguh-test-{uuid.uuid4().hex[:10]}"
        url = _with_query(REDIS_URL, prefix=prefix)
    if request.param == "postgres":
        import psycopg

        try:
            psycopg.connect(POSTGRES_URL, connect_timeout=5).close()
        except Exception as exc:  # noqa: BLE001
            _unavailable("postgres", exc)
        schema = f"tangguh_test_{uuid.uuid4().hex[:10]}"
        url = _with_query(POSTGRES_URL, schema=schema)
    d = Daemon(tmp, broker_url=url, handler_files=("testjobs.py", "webjobs.py"))
    d.config["broker"]["queues"] = ["default", "other"]
    d.config["web"] = {"redact": ["card_number"],
                       "users": {"ada": {"password": auth.hash_password(ADMIN_PW), "role": "admin"},
                                 "vic": {"password": auth.hash_password(VIEWER_PW), "role": "viewer"}}}
    d.config["schedules"] = {"nightly-export": {"cron": "0 3 * * *", "type": "export",
                                                "payload": {"customer_id": 7, "card_number": SECRET}}}
    d.write_config()
    # A schedule that ran before (a new one starts from now): its latest tick's job is the last run.
    from supervisor import scheduler
    from supervisor.model import NewJob

    sched = scheduler.schedules_from(config.load(d.config_path), {})["nightly-export"]
    d.broker.migrate()
    (tick,) = sched.latest(d.broker.now(), 1)
    d.broker.enqueue_once(NewJob("export", {"customer_id": 7, "card_number": SECRET},
                                 idempotency_key=scheduler.tick_key("nightly-export", tick)),
                          schedule="nightly-export")
    console = None
    recording = os.environ.get("TANGGUH_RECORD_SCREENSHOTS") == "1" and request.param == "sqlite"
    shots = DOCS if recording else tmp / "screenshots"
    shots.mkdir(parents=True, exist_ok=True)
    try:
        d.start()
        console = Console(d)
        s = Stack(request.param, d, console, driver, shots)
        s.login("ada", ADMIN_PW)
        yield s
    finally:
        if console is not None:
            console.stop()
        d.stop()
        if prefix is not None:
            import redis

            client = redis.Redis.from_url(REDIS_URL)
            for key in client.scan_iter(match=f"{prefix}*", count=1000):
                client.delete(key)
            client.close()
        if schema is not None:
            import psycopg

            with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
                conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


@pytest.fixture
def admin(stack):
    if stack.text(".who") is None or "ada" not in stack.text(".who"):
        stack.login("ada", ADMIN_PW)
    stack.driver.get_log("browser")  # start each test with an empty browser log
    return stack


# -- the tests ------------------------------------------------------------------------

def test_log_in_and_a_wrong_password_is_refused(stack):
    stack.driver.delete_all_cookies()
    stack.open("/jobs")
    assert stack.driver.current_url.endswith("/login?next=/jobs")
    stack.find("#name").send_keys("ada")
    stack.find("#password").send_keys("not-the-password")
    stack.find("#login-button").click()
    wait_for(lambda: stack.text("#login-error") == "Wrong name or password.", timeout=10, message="the refusal")
    stack.shot("login")
    stack.login("ada", ADMIN_PW)
    assert stack.text("h1").startswith("Overview")


def test_the_overview_shows_a_queue_depth_change_live(admin):
    s = admin
    for i in range(12):
        s.daemon.enqueue("export", {"customer_id": i})
    s.broker.pause("other", "test")
    s.open("/")
    row = 'tr[data-queue="other"] [data-k="ready"]'
    wait_for(lambda: s.text(row) == "0", timeout=10, message="the other queue to show 0 ready")
    s.mark_page()
    first = [s.daemon.enqueue("noop", {"i": i}, queue="other") for i in range(3)][0]
    wait_for(lambda: s.text(row) == "3", timeout=10, message="the overview to show 3 ready without a reload")
    waiting = 'tr[data-queue="other"] [data-k="waiting"]'
    assert s.text(waiting) == "0"
    s.daemon.enqueue("noop", {"callback": True}, queue="other", depends_on=[first])
    wait_for(lambda: s.text(waiting) == "1", timeout=10, message="a callback waiting on its parent, live")
    assert s.same_page()
    assert s.text('tr[data-queue="other"] [data-k="paused"]') == "paused"
    s.broker.resume("other")
    wait_for(lambda: s.text(row) == "0" and s.text(waiting) == "0", timeout=20,
             message="the jobs, the callback too, to run once resumed")
    wait_for(lambda: s.text('tr[data-queue="default"] [data-k="done"]') not in (None, "0"), timeout=20,
             message="done jobs on the overview")
    s.shot("overview")
    assert s.browser_errors() == []


def test_an_open_overview_says_when_its_live_updates_stop_for_good(admin):
    """Logged out in another tab (or the console restarted with new keys), the stream is refused and
    the browser gives up on it: the figures froze with only the live dot going grey."""
    s = admin
    s.open("/")
    wait_for(lambda: "on" in (s.find("#live-dot").get_attribute("class") or ""), timeout=10, message="live")
    s.mark_page()
    try:
        assert s.post("/logout", {"csrf": s.find("input[name=csrf]").get_attribute("value")}) in (0, 303)
        wait_for(lambda: "reload the page" in (s.text("#banners") or ""), timeout=20, message="the stopped banner")
        assert s.same_page()
    finally:
        s.login("ada", ADMIN_PW)


def test_find_a_job_by_a_payload_field_open_it_and_see_its_traceback(admin):
    s = admin
    job_id = s.daemon.enqueue("poison", {"customer_id": 4242, "card_number": SECRET}, max_attempts=1)
    s.daemon.enqueue("poison", {"customer_id": 4243}, max_attempts=1)
    assert s.daemon.wait_job(job_id).state == "dead"
    s.open("/jobs")
    s.find("#f-where").send_keys("customer_id=4242")
    s.find("#search-button").click()
    wait_for(lambda: s.links("#jobs-table a") == [job_id], timeout=10, message="the search's one match")
    wait_for(lambda: s.text("#match-count") == "1 matching job", timeout=10, message="the count, fetched after the page")
    s.shot("jobs")
    s.driver.find_element(By.LINK_TEXT, job_id).click()
    assert s.text("#job-state") == "dead"
    assert "ValueError: poison attempt 1" in s.text("#traceback")
    assert "Traceback (most recent call last)" in s.text("#traceback")
    assert job_id in s.text("#grep-line")
    assert SECRET not in s.driver.page_source
    s.shot("job-dead")
    assert s.browser_errors() == []


def test_cancel_a_running_job_and_watch_it_become_cancelled_without_a_reload(admin):
    s = admin
    outside = s.daemon.enqueue("long_export", {"max_wait": 60})
    wait_for(lambda: s.daemon.job(outside).state == "running", timeout=20, message="the job to run")
    s.open(f"/jobs/{outside}")
    wait_for(lambda: (s.text("#job-progress-text") or "-") != "-", timeout=10, message="live progress")
    s.shot("job-running")
    s.mark_page()
    # Cancelled elsewhere (another operator, the command line) while this page stays open.
    assert s.broker.cancel([outside], "ops", "wrong customer") == {outside: "requested"}
    wait_for(lambda: s.text("#job-state") == "cancelled", timeout=20, message="the page to show cancelled")
    assert s.same_page()
    assert "ops" in s.text("#job-cancel-request")
    # A finished job has nothing to cancel: the button goes (the page's CSS kept it shown).
    wait_for(lambda: not s.find("#job-cancel").is_displayed(), timeout=10, message="the cancel button to go")

    clicked = s.daemon.enqueue("long_export", {"max_wait": 60})
    wait_for(lambda: s.daemon.job(clicked).state == "running", timeout=20, message="the second job to run")
    s.open(f"/jobs/{clicked}")
    s.find("#job-cancel").click()
    s.driver.switch_to.alert.accept()
    wait_for(lambda: s.text("#job-state") == "cancelled", timeout=20, message="the clicked cancel to land")
    assert s.daemon.job(clicked).state == "cancelled"
    assert s.browser_errors() == []


def test_replay_a_dead_letter_and_see_it_done(admin):
    s = admin
    failing = os.path.join(s.daemon.dir, "export-fails")
    open(failing, "w").close()
    job_id = s.daemon.enqueue("export", {"customer_id": 99, "fail_while": failing}, max_attempts=1)
    assert s.daemon.wait_job(job_id).state == "dead"
    os.unlink(failing)
    s.open("/dead")
    s.shot("dead")
    s.find(f'input.pick[value="{job_id}"]').click()
    s.find("#replay-selected").click()
    wait_for(lambda: "1 replayed" in (s.text(".flash") or ""), timeout=10, message="the replay's message")
    s.open(f"/jobs/{job_id}")
    wait_for(lambda: s.text("#job-state") == "done", timeout=20, message="the replayed job to be done")
    wait_for(lambda: '"rows": 3' in s.text("#result"), timeout=10, message="the result shown live")
    s.open(f"/jobs/{job_id}")
    assert [td.text for td in s.driver.find_elements(By.CSS_SELECTOR, "#attempts tbody td:nth-child(2)")] == [
        "dead", "done"]
    s.shot("job")
    assert s.browser_errors() == []


def test_a_long_unbroken_error_and_resource_wrap_inside_the_job_page(admin):
    """An error message with no space in it (a URL, a blob, an id list) ran off the card: the
    job page scrolled sideways for metres, the buttons and facts a screen away from the error."""
    s = admin
    failing = os.path.join(s.daemon.dir, "export-fails-long")
    open(failing, "w").close()
    job_id = s.daemon.enqueue("export", {"customer_id": "c" * 3000, "fail_while": failing}, max_attempts=1,
                              resource_id="r" * 200)
    assert s.daemon.wait_job(job_id).state == "dead"
    os.unlink(failing)
    s.open(f"/jobs/{job_id}")
    wait_for(lambda: "export failed" in (s.text(".error-card p") or ""), timeout=10, message="the error shown")
    s.shot("job-long-error")
    assert s.driver.execute_script("return document.documentElement.scrollWidth <= window.innerWidth")
    assert s.browser_errors() == []


def test_purging_selected_dead_letters_asks_first(admin):
    """Every other button that destroys asks first; Purge selected deleted the ticked dead letters
    (all fifty after 'select this page') at the first click."""
    s = admin
    failing = os.path.join(s.daemon.dir, "export-fails-purge")
    open(failing, "w").close()
    job_id = s.daemon.enqueue("export", {"customer_id": 98, "fail_while": failing}, max_attempts=1)
    assert s.daemon.wait_job(job_id).state == "dead"
    os.unlink(failing)
    s.open("/dead")
    s.find(f'input.pick[value="{job_id}"]').click()
    s.find("#purge-selected").click()
    s.driver.switch_to.alert.dismiss()  # no alert (no question asked) fails here
    assert s.daemon.job(job_id).state == "dead"
    s.find("#purge-selected").click()
    s.driver.switch_to.alert.accept()
    wait_for(lambda: "1 purged" in (s.text(".flash") or ""), timeout=10, message="the purge's message")
    assert s.daemon.job(job_id) is None
    assert s.browser_errors() == []


def test_pause_a_queue_see_no_job_of_it_start_and_resume_it(admin):
    s = admin
    s.open("/queues")
    s.find("#pause-default").click()
    wait_for(lambda: (s.text('tr[data-queue="default"] .queue-state') or "").startswith("paused"), timeout=10,
             message="the queue shown paused")
    wait_for(lambda: "default" in s.daemon.status().get("paused_queues", []), timeout=20,
             message="the supervisor to see the pause")
    held = s.daemon.enqueue("noop", {"held": True})
    other = s.daemon.enqueue("noop", {"other": True}, queue="other")
    # The supervisor claims "default" before "other": "other" done while "default" waits is the pause at work.
    assert s.daemon.wait_job(other).state == "done"
    assert s.daemon.job(held).state == "queued"
    s.open("/queues")
    s.shot("queues")
    s.find("#resume-default").click()
    wait_for(lambda: s.text('tr[data-queue="default"] .queue-state') == "running", timeout=10,
             message="the queue shown running")
    assert s.daemon.wait_job(held).state == "done"


def test_a_filter_of_two_states_and_a_key_survives_a_new_search_and_the_bulk_confirmations_cancel(admin):
    """A URL with two states (as the API and the command line take them) lost the second when its
    form was searched again; the key had no field; the confirmation's Cancel lost the order."""
    from urllib.parse import parse_qsl, urlsplit

    from selenium.webdriver.support.ui import Select

    s = admin
    key = f'k-"<i>{uuid.uuid4().hex[:8]}&amp;'
    job_id = s.daemon.enqueue("noop", {"keyed": True}, idempotency_key=key, delay=3600)
    s.daemon.enqueue("noop", {"keyed": False}, delay=3600)
    s.open("/jobs?state=queued&state=retrying&order=oldest")
    ticked = [box.get_attribute("value") for box in s.driver.find_elements(By.CSS_SELECTOR, "#f-state input:checked")]
    assert ticked == ["queued", "retrying"]
    s.find("#f-key").send_keys(key)
    s.find("#search-button").click()
    wait_for(lambda: s.links("#jobs-table a") == [job_id], timeout=10, message="the keyed job alone")
    asked = sorted(parse_qsl(urlsplit(s.driver.current_url).query))
    assert [v for k, v in asked if k == "state"] == ["queued", "retrying"]
    assert ("idempotency_key", key) in asked and ("order", "oldest") in asked
    assert s.find("#f-key").get_attribute("value") == key
    s.shot("jobs-filter")
    Select(s.find("#bulk-scope")).select_by_value("filter")
    s.find("#bulk-cancel").click()
    wait_for(lambda: s.text("#confirm-count") == "1", timeout=10, message="the confirmation")
    s.shot("confirm")
    s.find("#confirm-back").click()
    wait_for(lambda: s.text("h1") == "Jobs", timeout=10, message="back on the Jobs page")
    assert sorted(parse_qsl(urlsplit(s.driver.current_url).query)) == asked
    assert s.daemon.job(job_id).state == "queued"
    assert s.browser_errors() == []


def test_a_workflow_childs_page_lists_its_parents_and_links_to_them(admin):
    s = admin
    first = s.daemon.enqueue("noop", {"step": 1})
    assert s.daemon.wait_job(first).state == "done"
    later = s.daemon.enqueue("noop", {"step": 2}, delay=3600)
    child = s.daemon.enqueue("noop", {"step": 3}, depends_on=[first, later])
    s.open(f"/jobs/{child}")
    rows = s.driver.find_elements(By.CSS_SELECTOR, "#parents tbody tr")
    got = sorted((r.find_element(By.CSS_SELECTOR, "a").text, r.find_element(By.CSS_SELECTOR, ".state").text)
                 for r in rows)
    assert got == sorted([(first, "done"), (later, "queued")])
    s.shot("job-parents")
    s.driver.find_element(By.LINK_TEXT, later).click()
    wait_for(lambda: s.text("h1") == later, timeout=10, message="the parent's page")
    assert s.browser_errors() == []


def test_a_queue_paused_from_the_command_line_with_no_job_shows_and_resume_all_resumes_it(admin):
    s = admin
    s.broker.pause("ghost", "cli")
    s.open("/queues")
    assert (s.text('tr[data-queue="ghost"] .queue-state') or "").startswith("paused by cli")
    s.shot("queues-ghost")
    s.find("#resume-all").click()
    wait_for(lambda: s.broker.paused() == {}, timeout=10, message="every queue resumed")
    assert s.find('tr[data-queue="default"] .queue-state').text == "running"
    assert s.browser_errors() == []


def test_a_viewer_sees_no_action_buttons_and_posts_without_the_token_are_refused(stack):
    s = stack
    job_id = s.daemon.enqueue("noop", {"x": 1})
    s.daemon.wait_job(job_id)
    s.login("vic", VIEWER_PW)
    for path in ("/", "/jobs", f"/jobs/{job_id}", "/dead", "/queues", "/schedules", "/supervisors"):
        s.open(path)
        buttons = [b.text for b in s.driver.find_elements(By.CSS_SELECTOR, "main button")]
        assert buttons in ([], ["Search"]), (path, buttons)
    token = s.find('input[name="csrf"]').get_attribute("value")
    assert s.post("/queues/pause", {"csrf": token, "queue": "default"}) == 403
    assert s.broker.paused() == {}
    s.login("ada", ADMIN_PW)
    s.open("/queues")
    assert s.post("/queues/pause", {"queue": "default"}) == 403  # an admin, but no CSRF token
    assert s.broker.paused() == {}


def test_a_redacted_field_never_appears_in_the_page_source_or_the_api(admin):
    s = admin
    job_id = s.daemon.enqueue("export", {"customer_id": 5, "card_number": SECRET})
    assert s.daemon.wait_job(job_id).state == "done"
    for path in (f"/jobs/{job_id}", f"/api/jobs/{job_id}", "/jobs?where=customer_id%3D5", "/api/jobs?type=export",
                 "/schedules", "/api/schedules"):
        s.open(path)
        assert SECRET not in s.driver.page_source, path
    s.open(f"/jobs/{job_id}")
    assert '"card_number": "***"' in s.text("#payload") and '"card_number": "***"' in s.text("#result")


def test_every_page_renders_without_a_browser_error(admin):
    s = admin
    for path, name in (("/schedules", "schedules"), ("/supervisors", "supervisors"), ("/jobs?state=done", None),
                       ("/jobs/job_unknown", "not-found")):
        s.open(path)
        if name:
            s.shot(name)
    assert s.text("#error-message") == "no job job_unknown"
    s.open("/schedules")  # the latest tick's job (the fixture's record of an earlier run) is the last run
    assert s.text("#schedule-table .state") in ("queued", "running", "done")
    s.open("/supervisors")
    assert s.text("main h2").startswith(socket.gethostname())
    assert [e for e in s.browser_errors() if "job_unknown" not in e["message"]] == []
