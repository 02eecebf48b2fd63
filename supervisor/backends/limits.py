"""Per-type claim limits, the part the SQL brokers share (see ``Broker.claim``).

A claim with limits loads, once, the leased jobs of the limited types (type
and resource: a scan of the leased jobs only, through the index every broker
has on them, so no new index slows the plain claim) and the rate tokens;
``Admission`` then decides job by job, in claim order, which candidates may be
leased. The broker's candidate query leaves out the types with no room left
(``blocked``) and the busy resources (``busy``), so a flood of held-back jobs
is skipped by the query, not walked in Python. Redis does the same inside its
claim script.
"""
from ..errors import BadInput
from ..model import TypeLimits


def refill(tokens, updated_at, now, count, per):
    """A token bucket's tokens at ``now``: ``tokens`` at ``updated_at`` plus the refill, capped."""
    if tokens is None:
        return float(count)  # a new bucket starts full
    return min(float(count), tokens + max(0.0, now - updated_at) * count / per)


class Admission:
    """What one claim may still lease under ``limits`` ({type: TypeLimits})."""

    def __init__(self, limits, leased, tokens):
        """``leased``: (type, resource_id) of every leased job of the limited types."""
        self.limits = limits
        self.room = {t: lim.max_concurrency for t, lim in limits.items() if lim.max_concurrency is not None}
        self.busy = set()  # (type, resource_id) leased, of exclusive types; this claim's leases join it
        for type_, resource_id in leased:
            if type_ in self.room:
                self.room[type_] -= 1
            if resource_id is not None and limits[type_].exclusive:
                self.busy.add((type_, resource_id))
        self.tokens = dict(tokens)  # type -> tokens now (rate-limited types only)

    def blocked(self):
        """Types nothing more may be leased of in this claim."""
        out = {t for t, room in self.room.items() if room <= 0}
        out.update(t for t, tokens in self.tokens.items() if tokens < 1)
        return sorted(out)

    def admit(self, type_, resource_id):
        """True (and the room taken) when a job of ``type_`` on ``resource_id`` may be leased."""
        lim = self.limits.get(type_)
        if lim is None:
            return True
        if self.room.get(type_, 1) <= 0 or self.tokens.get(type_, 1) < 1:
            return False
        if lim.exclusive and resource_id is not None:
            if (type_, resource_id) in self.busy:
                return False
            self.busy.add((type_, resource_id))
        if type_ in self.room:
            self.room[type_] -= 1
        if type_ in self.tokens:
            self.tokens[type_] -= 1
        return True


def active(limits):
    """The limits that limit something, or None: an empty result means the plain claim."""
    if not limits:
        return None
    for name, lim in limits.items():
        if not isinstance(lim, TypeLimits):
            raise BadInput(f"limits[{name!r}] must be a TypeLimits, got {type(lim).__name__}")
        lim.validate()  # before its truth is asked: an exclusive that is no bool made __bool__ raise
    return {t: lim for t, lim in limits.items() if lim} or None
