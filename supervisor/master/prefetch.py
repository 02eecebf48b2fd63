"""How many jobs of each type to claim beyond the idle children (``broker.prefetch``).

A prefetched job waits in the master until a child of this supervisor is free.
For a job type that runs in milliseconds that wait is nothing and saves a
broker round trip per job; for a long type it is a trap (Celery's prefetch
multiplier is the known one): the job sits behind a running one while a
sibling supervisor may be idle. ``"auto"`` therefore keeps, per job type, a
moving average of its run time and prefetches only as many jobs of it as the
children get through within ``WAIT_BUDGET``; a type never measured yet, or
slower than that, gets none; and no more than ``BYTES`` of one type's jobs (a
job waits decoded, several times its size). Jobs a claim brought beyond that
are handed back, except that a type whose average is under ``BAND_UNDER``
keeps up to ``KEEP`` times its prefetch (``keep``). A number pins the prefetch
for every type.
"""
WAIT_BUDGET = 0.05  # seconds a claimed job may expect to wait for a free child
PER_CHILD = 32  # most prefetched jobs per child, however short the type
WEIGHT = 0.2  # weight of the newest run time in the moving average
BATCH = 32  # most jobs in one message to a child
REFILL = BATCH // 2  # a busy child with fewer short jobs queued than this gets the next batch
# One run longer than this stops batching to its child: an outlier of a short type (its
# average is what makes it batchable), kept above a scheduler hiccup or a GC pause.
LONG_RUN = WAIT_BUDGET / 8
# A claimed job of a type whose average run is under BAND_UNDER is handed back only beyond KEEP
# times its prefetch. Such a type's average moves with every run (one scheduler's hiccup of 20 ms
# takes a 1 ms no-op's to 5 ms), and each job handed back costs a broker round trip and a claim:
# without the band, a busy 2-core machine handed back 4 % of its no-op jobs and spent a fifth of
# the master's wall time in those releases (bench/README.md). A slower type keeps no more than its
# prefetch: a few round trips are nothing beside its runs, and its jobs would wait KEEP times longer.
KEEP = 4
BAND_UNDER = WAIT_BUDGET / 4
# Most bytes of one type's jobs waiting prefetched (as measured in the messages to the children):
# a job waits decoded, several times its size, so a type with large payloads gets fewer.
BYTES = 8 * 2**20


class Prefetch:
    batch, refill = BATCH, REFILL

    def __init__(self, setting, workers):
        self.averages = {}  # job type -> moving average of its run time, seconds
        self.sizes = {}  # job type -> moving average of one job's bytes in a message to a child
        self.served = None  # the handlers' types: only those are measured (None: any)
        self.configure(setting, workers, None)

    def configure(self, setting, workers, served):
        """The setting and pool size of a (new) generation; forget types no longer ``served``."""
        self.auto = setting == "auto"
        self.pinned = 0 if self.auto else setting
        self.workers = workers
        if served is not None:  # bounded: only served types are measured
            self.served = frozenset(served)
            self.averages = {t: a for t, a in self.averages.items() if t in self.served}
            self.sizes = {t: a for t, a in self.sizes.items() if t in self.served}

    def ran(self, job_type, seconds):
        """A job of ``job_type`` ran for ``seconds`` (the child's measure)."""
        if not isinstance(seconds, (int, float)) or seconds < 0:
            return
        if self.served is not None and job_type not in self.served:
            return  # a producer's unknown type names must not grow the table until a reload
        before = self.averages.get(job_type)
        self.averages[job_type] = seconds if before is None else before + WEIGHT * (seconds - before)

    def slower(self, job_type, seconds):
        """Whether a run of ``seconds`` would raise ``job_type``'s average, the only way
        ``ran`` can lower what the type may ``keep`` (less the longer its average)."""
        before = self.averages.get(job_type)
        return before is not None and isinstance(seconds, (int, float)) and seconds > before

    def weigh(self, job_types, nbytes):
        """One message of jobs of ``job_types`` (a batch) to a child took ``nbytes``."""
        if not job_types:
            return
        each = nbytes / len(job_types)
        for job_type in set(job_types):
            if self.served is not None and job_type not in self.served:
                continue
            before = self.sizes.get(job_type)
            self.sizes[job_type] = each if before is None else before + WEIGHT * (each - before)

    def for_type(self, job_type):
        """Jobs of ``job_type`` that may wait prefetched here: as many as run within
        ``WAIT_BUDGET`` and not more than ``BYTES`` of them (a pinned number is the operator's)."""
        if not self.auto:
            return self.pinned
        return min(self._by_time(job_type), self._by_bytes(job_type))

    def keep(self, job_type):
        """Jobs of ``job_type`` that, once claimed, may stay prefetched: for a type whose average
        run is under ``BAND_UNDER``, ``KEEP`` times as many as ``for_type`` by run time (a band,
        so that a noisy average does not hand jobs back and forth), else ``for_type`` (a long
        type keeps none); never more than ``BYTES`` of them."""
        if not self.auto:
            return self.pinned
        average = self.averages.get(job_type)
        band = KEEP if average is not None and average < BAND_UNDER else 1
        return min(band * self._by_time(job_type), self._by_bytes(job_type))

    def _by_time(self, job_type):
        average = self.averages.get(job_type)
        if average is None:
            return 0  # not measured yet: run it first, prefetch once its run time is known
        most = PER_CHILD * self.workers
        # Compared before dividing: a child's reply may say 5e-324 s, and the budget over that is inf.
        return most if average * most <= WAIT_BUDGET * self.workers else int(WAIT_BUDGET * self.workers / average)

    def _by_bytes(self, job_type):
        size = self.sizes.get(job_type)
        return int(BYTES / size) if size else PER_CHILD * self.workers

    def batchable(self, job_type):
        """Whether jobs of ``job_type`` may share a message to a child: a whole batch of
        them is expected to run within ``WAIT_BUDGET`` (measured; prefetch pinned or not)."""
        average = self.averages.get(job_type)
        return average is not None and average * BATCH <= WAIT_BUDGET

    def long(self, seconds):
        """Whether one run of ``seconds`` is too long to have jobs batched behind it."""
        return isinstance(seconds, (int, float)) and seconds > LONG_RUN

    def room(self):
        """Jobs a claim may take beyond the idle children: the most any type allows.

        A claim cannot choose types; jobs beyond what their type may ``keep`` are
        handed back by the dispatcher (``surplus``) at once.
        """
        if not self.auto:
            return self.pinned
        return max((self.for_type(t) for t in self.averages), default=0)

    def view(self):
        """For ``status``: the prefetch chosen for each measured type, and how many of it a claim may leave here."""
        return {"mode": "auto" if self.auto else self.pinned,
                "types": [{"type": t, "prefetch": self.for_type(t), "keep": self.keep(t),
                           "average_seconds": round(a, 6), "average_bytes": round(self.sizes.get(t, 0))}
                          for t, a in sorted(self.averages.items())]}
