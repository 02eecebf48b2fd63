"""The child worker: what runs in each forked process.

``worker`` is the child's life (one job at a time from its pipe, the handler,
the reply), ``context`` is the ``ctx`` a handler receives, and ``timeouts``
raises ``JobTimeout`` inside a handler past its soft timeout.
"""


def __getattr__(name):
    # ``import supervisor`` loads ``timeouts`` (for ``JobTimeout``) and so this
    # package: the worker and what it imports load only when a child needs them.
    if name in ("main", "run_job"):
        from . import worker

        return getattr(worker, name)
    raise AttributeError(f"module 'supervisor.child' has no attribute {name!r}")
