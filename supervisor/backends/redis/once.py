"""The Redis broker's ``enqueue_once`` records: ``last_once_key``.

The records are ``P:{Q}:once`` zsets (see ``keys.py``), scored by first use,
so the newest key of a prefix is found by a ``ZSCAN ... MATCH`` of each
queue's set. The scheduler asks at its first check of a schedule only (a
start, a reload that changed it), never per tick.
"""
import re

from .connection import guard


def _glob_literal(text):
    return re.sub(r"([\\*?\[\]])", r"\\\1", text)


class OnceRecords:
    @guard
    def last_once_key(self, prefix):
        match = _glob_literal(prefix) + "*"
        best = None
        for queue in sorted(self.r.smembers(self.keys.queues)):
            for key, _ in self.r.zscan_iter(self.keys.once(queue), match=match, count=1000):
                if key.startswith(prefix) and (best is None or key > best):
                    best = key
        return best
