"""The outcome writer against a real SQLite broker: what it stores, and what it drops."""
from supervisor.backends import open_broker
from supervisor.master.brokerlink import BrokerLink
from supervisor.master.outcomes import OutcomeWriter
from supervisor.metrics import Metrics
from supervisor.model import ACK, Lease, NewJob, Outcome

from .util import wait_for


def writer_on(url):
    import selectors

    link = BrokerLink(url, True, selectors.DefaultSelector(), Metrics(), on_wakeup=lambda: None,
                      on_down=lambda t: None, pid=0)
    unheld, stored, lost = [], [], []
    writer = OutcomeWriter(link, unhold=unheld.append, on_stored=stored.append, on_lost=lost.append)
    return writer, link, unheld, stored, lost


def test_a_lease_found_lost_before_its_ack_is_counted_once_and_not_written(sqlite_url):
    writer, link, unheld, stored, lost = writer_on(sqlite_url)
    with open_broker(sqlite_url) as broker:
        broker.migrate()
        job_id = broker.enqueue(NewJob("t", {}))
        job = broker.claim(["default"], 1, 0.01, "a")[0]
        # Once the lease has expired, a second owner reclaims the job under a new token.
        again = wait_for(lambda: broker.claim(["default"], 1, 30, "b"), timeout=10, message="the reclaim")
    writer.add(job, Outcome(ACK, result=1), {})
    writer.forget(Lease(job.id, job.token))  # what the heartbeat's lost lease does
    writer.flush()
    assert len(writer) == 0 and stored == [] and lost == []  # nothing written, nothing counted again
    with open_broker(sqlite_url) as broker:
        current = broker.get(job_id)
    assert (current.state, current.token, current.owner) == ("running", again[0].token, "b")
    link.drop()


def test_other_outcomes_are_kept_when_one_lease_is_lost(sqlite_url):
    writer, link, unheld, stored, lost = writer_on(sqlite_url)
    with open_broker(sqlite_url) as broker:
        broker.migrate()
        ids = [broker.enqueue(NewJob("t", {"n": n})) for n in range(2)]
        jobs = broker.claim(["default"], 2, 30, "a")
    for job in jobs:
        writer.add(job, Outcome(ACK, result=job.payload["n"]), {})
    writer.forget(jobs[0].lease)
    wait_for(lambda: writer.flush() or not len(writer), timeout=10, message="the ack's linger to pass")
    with open_broker(sqlite_url) as broker:
        states = {i: broker.get(i).state for i in ids}
    assert states == {jobs[0].id: "running", jobs[1].id: "done"} and len(stored) == 1
    link.drop()
