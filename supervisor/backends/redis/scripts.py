"""The Redis broker's Lua scripts: one per state change, read from ``redis_lua/``.

Every script starts with ``_common.lua``, ``_control.lua``, ``_search.lua`` and ``_flows.lua`` (the shared helpers); a composed one
is several files run in order, the first of which may return early. The files
ship as package data beside this package (``supervisor/backends/redis_lua/``).
"""
import functools
import os

NAMES = ("enqueue", "claim", "extend", "ack", "retry", "dead", "release", "replay", "purge", "stats", "prune",
         "claim_limited", "enqueue_once", "ack_many", "requeue", "discard", "search_page", "search_states",
         "search_sizes", "enqueue_flow")
# Job control's scripts (redis/control.py).
CONTROL_NAMES = ("cancel", "renew", "cancelled", "mark_waited")
# A script made of several files, run in order (the first may return early).
COMPOSED = {"enqueue_once": ("enqueue_once", "enqueue")}
# Prepended to every script: the shared helpers, job control's, the search indexes', then the workflows' settle/reopen.
PRELUDE = ("_common.lua", "_control.lua", "_search.lua", "_flows.lua")
LUA_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "redis_lua")


@functools.cache
def sources():
    """{name: Lua source}, read once per process."""
    common = ""
    for prelude in PRELUDE:
        with open(os.path.join(LUA_DIR, prelude), encoding="utf-8") as f:
            common += f.read() + "\n"
    out = {}
    for name in NAMES + CONTROL_NAMES:
        parts = [common]
        for part in COMPOSED.get(name, (name,)):
            with open(os.path.join(LUA_DIR, f"{part}.lua"), encoding="utf-8") as f:
                parts.append(f.read())
        out[name] = "\n".join(parts)
    return out


def register(client):
    """{name: redis-py Script} on ``client`` (no round trip: each is sent on first use)."""
    return {name: client.register_script(source) for name, source in sources().items()}


def load(client, scripts):
    """Send every script to the server again (after it lost its script cache)."""
    for name, script in scripts.items():
        script.sha = client.script_load(sources()[name])
