"""Per-type claim limits, the part the SQL brokers share (see ``Broker.claim``).

A claim with limits loads, once, how many jobs of each limited type are
leased and how many rate tokens each has; ``Admission`` then decides job by
job, in claim order, which candidates may be leased. The broker's query
leaves out the types with no room left (``blocked``) and the resources that
are busy, so a flood of held-back jobs costs one skipped index range, not a
scan. Redis does the same inside its claim script.
"""


def refill(tokens, updated_at, now, count, per):
    """A token bucket's tokens at ``now``: ``tokens`` at ``updated_at`` plus the refill, capped."""
    if tokens is None:
        return float(count)  # a new bucket starts full
    return min(float(count), tokens + max(0.0, now - updated_at) * count / per)


class Admission:
    """What one claim may still lease under ``limits`` ({type: TypeLimits})."""

    def __init__(self, limits, running, tokens):
        self.limits = limits
        self.room = {t: lim.max_concurrency - running.get(t, 0)
                     for t, lim in limits.items() if lim.max_concurrency is not None}
        self.tokens = dict(tokens)  # type -> tokens now (rate-limited types only)
        self.taken = set()  # (type, resource_id) leased by this claim

    def blocked(self):
        """Types nothing more may be leased of in this claim."""
        out = {t for t, room in self.room.items() if room <= 0}
        out.update(t for t, tokens in self.tokens.items() if tokens < 1)
        return sorted(out)

    def exclusive(self):
        return sorted(t for t, lim in self.limits.items() if lim.exclusive)

    def admit(self, type_, resource_id):
        """True (and the room taken) when a job of ``type_`` on ``resource_id`` may be leased."""
        lim = self.limits.get(type_)
        if lim is None:
            return True
        if self.room.get(type_, 1) <= 0 or self.tokens.get(type_, 1) < 1:
            return False
        if lim.exclusive and resource_id is not None:
            if (type_, resource_id) in self.taken:
                return False
            self.taken.add((type_, resource_id))
        if type_ in self.room:
            self.room[type_] -= 1
        if type_ in self.tokens:
            self.tokens[type_] -= 1
        return True


def active(limits):
    """The limits that limit something, or None: an empty result means the plain claim."""
    if not limits:
        return None
    out = {t: lim for t, lim in limits.items() if lim}
    for lim in out.values():
        lim.validate()
    return out or None
