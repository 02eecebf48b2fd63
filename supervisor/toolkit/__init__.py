"""The handler toolkit: what a handler uses to make its effects safe to repeat.

``connections`` (the ``[toolkit]`` settings and each process's database and
Redis connections, re-exported here), ``transaction`` (``ctx.transaction()``),
``idempotency`` (``ctx.idempotency``), ``locks`` (``ctx.lock``, row and
advisory locks) and ``cache`` (``ctx.cache``). docs/safe-handlers.md shows
them in use.
"""
from .connections import (DEFAULT_RETENTION, Database, Settings, attach_master, check_urls, configure,  # noqa: F401
                          database, database_kind, end_job, migrate, notify_master, open_redis, preload, redis,
                          settings, split_query)
