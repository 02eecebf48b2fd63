"""``tangguh status --watch``: rendering of recorded status replies, rates from two samples, the redraw loop."""
import copy
import io
import time

from supervisor.cli import watch

T0 = 1_700_000_000.0

RECORDED = {
    "ok": True, "pid": 4100, "started_at": T0 - 3725, "generation": 2, "config": "/etc/tangguh/config.toml",
    "broker": "sqlite:////var/lib/tangguh/broker.db", "reload_error": None, "stopping": None, "broker_down": False,
    "target_workers": 2, "prefetched": 0, "pending_writes": 0, "restarts": 3,
    "workers": [
        {"slot": 0, "pid": 4101, "state": "busy", "job_id": "job_01JABCDEF", "job_type": "send_email",
         "attempt": 2, "elapsed": 12.34, "rss_bytes": 50331648, "jobs_done": 120, "generation": 2},
        {"slot": 1, "pid": 4102, "state": "idle", "job_id": None, "job_type": None, "attempt": None,
         "elapsed": None, "rss_bytes": 41943040, "jobs_done": 7, "generation": 2},
    ],
    "counters": {"succeeded": 100, "failed": 10, "retried": 8, "dead": 2, "timeouts": 1, "crashed": 0,
                 "lease_lost": 0},
    "handlers": ["send_email"],
    "queues": {"default": {"queue": "default", "ready": 42, "scheduled": 3, "waiting": 7, "in_flight": 1, "dead": 2,
                           "done": 900, "oldest_ready_age": 95.5},
               "low": {"queue": "low", "ready": 0, "scheduled": 0, "in_flight": 0, "dead": 0, "done": 0,
                       "oldest_ready_age": 0.0}},
    "metrics_listen": None,
}


class Clock:
    """A monotonic clock that moves only when slept on (or told to: ``advance``)."""

    def __init__(self, t):
        self.t, self.slept = t, []

    def __call__(self):
        return self.t

    def sleep(self, seconds):
        self.slept.append(round(seconds, 6))
        self.t += seconds

    def advance(self, seconds):
        self.t += seconds


def later(seconds, **counters):
    reply = copy.deepcopy(RECORDED)
    reply["counters"].update(counters)
    return T0 + seconds, reply


def test_render_a_recorded_status_without_rates():
    screen = watch.render_watch(RECORDED, T0)
    lines = screen.splitlines()
    assert lines[0].startswith("tangguh  pid 4100  gen 2  up 1h02m  running")
    # the queue table: depth and oldest age of the due jobs; no age when nothing is due; callbacks
    # waiting on their parents (a supervisor before the column: "-")
    assert next(line for line in lines if line.startswith("QUEUE")).split() == [
        "QUEUE", "READY", "SCHEDULED", "WAITING", "IN", "FLIGHT", "DEAD", "OLDEST"]
    default = next(line for line in lines if line.startswith("default")).split()
    assert default == ["default", "42", "3", "7", "1", "2", "1m35s"]
    low = next(line for line in lines if line.startswith("low")).split()
    assert low == ["low", "0", "0", "-", "0", "0", "-"]
    assert "workers 2/2  busy 1  restarts 3" in screen
    busy = next(line for line in lines if "job_01JABCDEF" in line).split()
    assert busy == ["0", "4101", "busy", "send_email", "job_01JABCDEF", "2", "12.3s"]
    idle = next(line for line in lines if line.split()[:3] == ["1", "4102", "idle"]).split()
    assert idle[3:] == ["-", "-", "-", "-"]
    assert "rates: waiting for a second sample" in screen
    assert "\033" not in screen  # the loop clears the screen; the text itself is plain


def test_rates_come_from_two_samples_a_minute_apart():
    now, newer = later(60, succeeded=160, failed=13, retried=10, dead=3)
    screen = watch.render_watch(newer, now, older=(T0, RECORDED))
    rates_line = next(line for line in screen.splitlines() if line.startswith("rates"))
    assert rates_line == ("rates over the last 1m00s, per minute: succeeded 60.0  failed 3.0  retried 2.0  dead 1.0"
                          "  timeouts 0.0  crashed 0.0  lease_lost 0.0")
    # Half a minute apart: the same increase is twice the rate.
    now, newer = later(30, succeeded=130)
    assert "succeeded 60.0" in watch.render_watch(newer, now, older=(T0, RECORDED))


def test_a_restarted_supervisor_or_an_error_shows_no_rates():
    now, newer = later(10, succeeded=1)
    newer["pid"] = 5000
    assert "rates: waiting for a second sample" in watch.render_watch(newer, now, older=(T0, RECORDED))
    screen = watch.render_watch({"error": "no supervisor answering on /run/tangguh.sock"}, T0)
    assert screen.splitlines()[1] == "error: no supervisor answering on /run/tangguh.sock"


def test_samples_keep_one_minute_and_the_loop_redraws_in_place():
    samples = watch.Samples()
    for i in range(0, 100, 10):
        samples.add(T0 + i, later(i)[1])
    assert samples.oldest()[0] == T0 + 30  # the newest at or before 90 - 60
    samples.add(T0 + 100, {"error": "gone"})
    assert samples.items[-1][0] == T0 + 90  # errors are not samples

    replies = iter([RECORDED, later(1, succeeded=101)[1], later(2, succeeded=102)[1]])
    clock, out = Clock(T0), io.StringIO()
    watch.run(lambda: next(replies), 1.0, out=out, clock=clock, sleep=clock.sleep, frames=3)
    frames = out.getvalue().split(watch.CLEAR)[1:]
    assert len(frames) == 3 and clock.slept == [1.0, 1.0]
    assert "waiting for a second sample" in frames[0]
    assert "succeeded 60.0" in frames[1] and "succeeded 60.0" in frames[2]


def test_rates_start_over_with_a_restarted_supervisor():
    """A restart (a new pid, or pid 1 again in a container: a new start time) starts the samples over."""
    def run_of(pid, started_at, seconds, succeeded):
        reply = later(seconds, succeeded=succeeded)[1]
        reply["pid"], reply["started_at"] = pid, started_at
        return reply

    replies = iter([RECORDED, later(1, succeeded=101)[1],  # the first run
                    run_of(5000, T0 + 1.5, 2, 0), run_of(5000, T0 + 1.5, 3, 1), run_of(5000, T0 + 1.5, 4, 2)])
    clock, out = Clock(T0), io.StringIO()
    watch.run(lambda: next(replies), 1.0, out=out, clock=clock, sleep=clock.sleep, frames=5)
    frames = out.getvalue().split(watch.CLEAR)[1:]
    assert "succeeded 60.0" in frames[1]
    assert "waiting for a second sample" in frames[2]  # the new run's first sample
    # From its second sample on, the new run's rates: not held back a minute by the old run's samples.
    assert "rates over the last 1.00s, per minute: succeeded 60.0" in frames[3]
    assert "rates over the last 2.00s, per minute: succeeded 60.0" in frames[4]

    # The same pid started again (a container's first process): its counters started over too.
    now, newer = later(10, succeeded=1)
    newer["started_at"] = T0 + 5
    assert "rates: waiting for a second sample" in watch.render_watch(newer, now, older=(T0, RECORDED))


def test_queue_counts_the_samples_fail_to_renew_say_how_old_they_are():
    """A count the broker gives up on (millions of dead letters) leaves the last counts standing:
    shown as they were, DEAD 2 could be days old. The screen says so."""
    now, reply = later(0)
    reply.update(queues_sampled_ago=3725.0, queues_sample_failing=True)
    screen = watch.render_watch(reply, now)
    assert "queue counts 1h02m old: the samples since failed (sample_failed in the log)" in screen
    reply.update(queues={}, queues_sampled_ago=None)
    assert "no queue counts yet: the samples failed" in watch.render_watch(reply, now)
    reply.update(queues=RECORDED["queues"], queues_sampled_ago=2.0, queues_sample_failing=False)
    assert "sample" not in watch.render_watch(reply, now).split("workers")[0]  # fresh counts: nothing to say


def test_a_step_of_the_wall_clock_neither_stalls_the_rates_nor_the_redraws():
    """The samples were timed on the wall clock: set back an hour (NTP, by hand), every later
    sample was older than the first, no rate was shown for an hour and none left the window
    (a reply kept every second); set forward, the rates were spread over the step."""
    replies = iter([RECORDED, later(1, succeeded=101)[1], later(2, succeeded=102)[1]])
    clock, out = Clock(500.0), io.StringIO()
    wall = lambda: T0 + clock() - 500.0 - (3600 if clock() >= 501.0 else 0)  # noqa: E731 - set back an hour
    watch.run(lambda: next(replies), 1.0, out=out, clock=clock, sleep=clock.sleep, frames=3, wall=wall)
    frames = out.getvalue().split(watch.CLEAR)[1:]
    assert "succeeded 60.0" in frames[1] and "succeeded 60.0" in frames[2]
    assert "rates over the last 2.00s" in frames[2]
    stamp = lambda t: time.strftime("%H:%M:%S", time.localtime(t))  # noqa: E731
    assert stamp(T0 + 1 - 3600) in frames[1].splitlines()[0]  # the screen says the wall time it is
    assert clock.slept == [1.0, 1.0]


def test_redraws_keep_their_interval_whatever_fetching_takes():
    """Slept a whole interval after each screen, a watch over a slow socket drew every interval
    plus the answer's time; one late past a whole interval is followed by one interval, not a burst."""
    answer_takes = iter([0.3, 0.3, 2.5, 0.1])
    clock, out = Clock(500.0), io.StringIO()

    def fetch():
        clock.advance(next(answer_takes))
        return RECORDED

    watch.run(fetch, 1.0, out=out, clock=clock, sleep=clock.sleep, frames=4)
    assert clock.slept == [0.7, 0.7, 1.0]
    assert watch.next_tick(10.0, 10.4, 1.0) == 11.0
    assert watch.next_tick(10.0, 13.5, 1.0) == 14.5  # late: from now, not 11, 12, 13 at once


def test_json_lines_keep_their_interval_whatever_fetching_takes():
    """``status --watch --json`` slept a whole interval after each line: over a slow socket it
    wrote every interval plus the answer's time, drifting. It is timed as the screen is."""
    answer_takes = iter([0.3, 0.3, 2.5, 0.1])
    clock, lines = Clock(500.0), []

    def fetch():
        clock.advance(next(answer_takes))
        return RECORDED

    watch.run_json(fetch, 1.0, lines.append, clock=clock, sleep=clock.sleep, count=4)
    assert lines == [RECORDED] * 4
    assert clock.slept == [0.7, 0.7, 1.0]


def test_json_lines_end_quietly_on_ctrl_c():
    def fetch():
        raise KeyboardInterrupt

    lines = []
    assert watch.run_json(fetch, 1.0, lines.append, clock=Clock(0.0), sleep=Clock(0.0).sleep) == 0
    assert lines == []
