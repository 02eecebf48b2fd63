"""Job control in the chaos soak: random cancels, pauses and resumes, and jobs that expire.

A mixin of ``engine.Soak``. Faults ``cancel`` (a running job, most of the
time, else any job of the run: queued, retrying, finished) and ``pause`` (the
queue, resumed a little later by a pending action). Expiring jobs come from the
producer (``EXPIRING`` of them get ``expires_in``). The invariants, from the
broker's history (every timestamp in it is the broker's clock, as are a cancel
request's and an expiry's):

* no attempt of a job starts after its cancel or its expiry was recorded;
* every job whose cancel was answered ``cancelled`` ends cancelled; one answered
  ``requested`` (it was running) ends cancelled, or done or dead when its attempt
  finished before the request reached it;
* only expiring jobs end expired, only cancelled ones end cancelled;
* no attempt starts while the queue is paused (between the pause's answer
  and the resume call).
"""
import time

from supervisor.backends import open_broker

EXPIRING = 0.06  # share of jobs enqueued with an expires_in (a few seconds: some expire under load)
QUEUE = "default"  # the soak's one queue
FAILED = object()  # what ``control_call`` returns when the broker did not answer


class ControlFaults:
    def init_control(self):
        self.cancels = []  # (job id, answer, wall time)
        self.pauses = []  # [paused wall time, resumed wall time or None]
        self.paused_now = False
        self.control_broker = None

    def control_call(self, fn):
        """``fn(broker)`` on the injector's own connection; FAILED while the broker is out (fault owed)."""
        if self.outage or self.broker_lock is not None or self.sqlite_stopped():
            # An injector blocked on a locked SQLite file could not end the outage, nor SIGCONT
            # the stopped master that may hold the lock.
            return FAILED
        try:
            if self.control_broker is None:
                self.control_broker = open_broker(self.broker_url)
            return fn(self.control_broker)
        except Exception:  # noqa: BLE001 - a restarted server's first refusal
            self.close_control()
            return FAILED

    def close_control(self):
        if self.control_broker is not None:
            try:
                self.control_broker.close()
            except Exception:  # noqa: BLE001
                pass
            self.control_broker = None

    def expires_in(self, rng):
        return round(rng.uniform(0.5, 4.0), 2) if rng.random() < EXPIRING else None

    # -- faults -----------------------------------------------------------------------------
    def fault_cancel(self):
        picked = self.busy_child() if self.rng_faults.random() < 0.7 else None
        if picked is not None:
            job_id = picked[1]["job_id"]
        elif self.ids:
            job_id = self.rng_faults.choice(list(self.ids.values()))
        else:
            return None
        answer = self.control_call(lambda br: br.cancel([job_id], by="chaos", reason="fault"))
        if answer is FAILED:
            return None
        self.cancels.append((job_id, answer[job_id], time.time()))
        return f"{job_id} {answer[job_id]}"

    def fault_pause(self):
        if self.paused_now:
            return None
        # No other pause until a resume lands: a resume sent in case a failed pause landed
        # would otherwise end the window of the next pause while the check still counts it open.
        self.paused_now = True
        if self.control_call(lambda br: br.pause(QUEUE, by="chaos")) is FAILED:
            self.later(0.5, self.resume_queue, False)  # in case the pause landed before the call failed
            return None
        self.pauses.append([time.time(), None])
        secs = round(self.rng_faults.uniform(0.3, 1.5), 2)
        self.later(secs, self.resume_queue)
        return f"{QUEUE} for {secs}s"

    def resume_queue(self, paused=True, started=None):
        # The window ends at the first attempt: a resume whose answer an outage cut may have landed.
        started = time.time() if started is None else started
        if self.control_call(lambda br: br.resume(QUEUE)) is FAILED:
            self.later(0.2, self.resume_queue, paused, started)  # the broker is out: again shortly
            return
        self.paused_now = False
        if not paused:
            return
        self.pauses[-1][1] = started
        self.note("resume", QUEUE)

    # -- invariants ---------------------------------------------------------------------------
    def finished_states(self, key, job):
        """The end states a job of this run may be in."""
        ok = {"done", "dead"}
        if job.expires_at is not None:
            ok.add("expired")
        if job.id in self.cancelled_ids:
            ok.add("cancelled")
        return ok

    @property
    def cancelled_ids(self):
        return {job_id for job_id, answer, _ in self.cancels if answer in ("cancelled", "requested")}

    def check_control(self, check, jobs):
        by_id = {j.id: j for j in jobs.values() if j}
        late = []
        for j in by_id.values():
            recorded = []
            if j.state == "cancelled" and isinstance(j.cancel_request, dict):
                recorded.append(j.cancel_request.get("at"))
            recorded += [h.get("at") for h in j.history if h.get("outcome") in ("expired", "cancelled")]
            recorded = [t for t in recorded if isinstance(t, (int, float))]
            if recorded:
                first = min(recorded)
                late += [(j.id, j.state, h["started_at"], first) for h in j.history
                         if isinstance(h.get("started_at"), (int, float)) and h["started_at"] > first]
        check("no attempt of a job starts after its cancel or its expiry was recorded", not late, f"{late[:5]}")
        wrong = []
        for job_id, answer, _ in self.cancels:
            j = by_id.get(job_id)
            if j is None:
                continue
            if answer == "cancelled" and j.state != "cancelled":
                wrong.append((job_id, answer, j.state))
            elif answer == "requested" and j.state not in ("cancelled", "done", "dead"):
                wrong.append((job_id, answer, j.state))
        answers = {}
        for _, answer, _ in self.cancels:
            answers[answer] = answers.get(answer, 0) + 1
        ended = sum(1 for job_id in self.cancelled_ids if by_id.get(job_id) and by_id[job_id].state == "cancelled")
        check("every cancelled job ends cancelled (or done/dead: finished before the request reached it)",
              not wrong, f"answers {answers}, ended cancelled {ended}; wrong {wrong[:5]}")
        paused = [(j.id, h["started_at"]) for j in by_id.values() for h in j.history for start, end in self.pauses
                  if end is not None and isinstance(h.get("started_at"), (int, float)) and start < h["started_at"] < end]
        if self.faults["pause"]:
            check("no attempt started while its queue was paused", self.pauses and not paused,
                  f"pauses {len(self.pauses)}, started inside {paused[:5]}")
        # Reported, not required: most chaos jobs end within a heartbeat, before their cancel is seen
        # (tests/test_job_control.py proves the running cancel on its own).
        running = sum(1 for job_id, answer, _ in self.cancels if answer == "requested"
                      and by_id.get(job_id) and by_id[job_id].state == "cancelled")
        self.control_report = {"cancel_answers": answers, "running_cancelled": running, "pauses": len(self.pauses),
                               "expired": sum(1 for j in by_id.values() if j.state == "expired")}
