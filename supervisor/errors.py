"""Exceptions shared by the producer API, the brokers and the handlers."""


class TangguhError(Exception):
    """Base class: every error Tangguh raises on purpose."""


class ConfigError(TangguhError):
    """The configuration is invalid. The message names the key path."""


class BadInput(TangguhError):
    """A caller passed something Tangguh cannot store (payload, queue, delay...)."""


class BrokerError(TangguhError):
    """The broker could not be reached or refused the call."""


class BrokerUnusable(BrokerError):
    """The broker URL can never work as written (bad option or port, unknown database, refused login).

    At start this is a configuration error (exit 2); a server that does not
    answer is an outage instead, waited out with the daemon running.
    """


class BrokerBusy(BrokerError):
    """The broker is there but another process holds it (a SQLite file locked past the busy timeout),
    or its disk is full.

    An outage, not a setup error: a daemon that meets it at start runs on and waits.
    """


class RolledBack(BrokerError):
    """The call failed and its transaction rolled back: nothing it did stands (a claim leased nothing).

    Only a broker that knows it says so (SQLite, in the caller's process); a server's failure may
    come after its commit, unseen.
    """


class LeaseLost(TangguhError):
    """A call presented a lease token that is no longer current.

    Raised by ack/retry/dead/release when another claim has taken the job since
    (fencing): the caller's outcome must be dropped, never applied.
    """

    def __init__(self, job_id, token):
        super().__init__(f"lease lost: job {job_id} token {token} is not the current lease")
        self.job_id = job_id
        self.token = token


class NotDead(TangguhError):
    """dlq_replay/dlq_purge was asked about a job that is not dead-lettered."""


class StopSignal(BaseException):
    """SIGTERM, SIGINT or SIGQUIT while the master starts: raised out of the handler files' import
    (a BaseException, so that a module's ``except Exception`` does not take it for its own)."""

    def __init__(self, signum):
        super().__init__(signum)
        self.signum = signum
