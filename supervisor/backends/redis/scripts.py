"""The Redis broker's Lua scripts: one per state change, read from ``redis_lua/``.

Every script starts with what it uses of ``_common.lua``, ``_control.lua``,
``_search.lua``, ``_flows.lua`` and ``_queue.lua`` (the shared helpers); a composed one is
several files run in order, the first of which may return early. The files
ship as package data beside this package (``supervisor/backends/redis_lua/``).

Only what a script uses: Redis runs a script's whole text on every call, and
every ``local function`` of the preludes is a closure made anew each time:
all four preludes cost an empty script about 20 µs of the server's time a
call, more than the work of a single enqueue.
"""
import functools
import os
import re

NAMES = ("enqueue", "claim", "extend", "ack", "retry", "dead", "release", "replay", "purge", "stats", "prune",
         "claim_limited", "enqueue_once", "ack_many", "requeue", "discard", "search_page", "search_states",
         "search_sizes", "enqueue_flow", "queue_empty", "resume")
# Job control's scripts (redis/control.py).
CONTROL_NAMES = ("cancel", "renew", "cancelled", "mark_waited")
# A script made of several files, run in order (the first may return early).
COMPOSED = {"enqueue_once": ("enqueue_once", "enqueue")}
# Prepended to every script: the shared helpers, job control's, the search indexes', the workflows'
# settle/reopen, then what looks at a queue as a whole.
PRELUDE = ("_common.lua", "_control.lua", "_search.lua", "_flows.lua", "_queue.lua")
LUA_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "redis_lua")


# A prelude's top-level statement starts at column 0: "local ..." or "name = function" (a
# function declared earlier with "local a, b"); its body and continuation lines are indented,
# its comments and "end" at column 0.
_STATEMENT = re.compile(r"local |\w+ = function")
_DEFINED = re.compile(r"local function (\w+)|local ([\w, ]+?)\s*(?:=|$)|(\w+) = function")
_WORD = re.compile(r"[A-Za-z_]\w*")
# A line at column 0 inside a statement is its "end" or a closing bracket: anything else matches here.
_UNKNOWN = re.compile(r"(?!end\b|[})\]]|\s|$)")


def statements(text):
    """A prelude's top-level statements as (names defined, source), comments kept with the next one."""
    out, comments = [], []
    for line in text.splitlines(keepends=True):
        if line.startswith("--"):
            comments.append(line)
        elif _STATEMENT.match(line):
            names = next(n for n in _DEFINED.match(line).groups() if n)
            out.append([{n.strip() for n in names.split(",")}, [*comments, line]])
            comments = []
        elif out and not _UNKNOWN.match(line):
            out[-1][1].append(line)
        elif line.strip():
            # A top-level line that defines nothing (a call run for its effect) would be kept
            # only with the statement before it: refuse to guess.
            raise ValueError(f"a prelude line that is no statement this reader knows: {line.strip()!r}")
    return [(names, "".join(lines)) for names, lines in out]


def used(preludes, body):
    """The statements of ``preludes`` that ``body`` needs (with what they need in turn), in order."""
    needed, chosen = set(_WORD.findall(body)), set()
    while True:
        more = [i for i, (names, _) in enumerate(preludes) if i not in chosen and names & needed]
        if not more:
            return "".join(preludes[i][1] for i in sorted(chosen))
        for i in more:
            chosen.add(i)
            needed |= set(_WORD.findall(preludes[i][1]))


@functools.cache
def sources():
    """{name: Lua source}, read once per process."""
    preludes = []
    for prelude in PRELUDE:
        with open(os.path.join(LUA_DIR, prelude), encoding="utf-8") as f:
            preludes += statements(f.read())
    out = {}
    for name in NAMES + CONTROL_NAMES:
        parts = []
        for part in COMPOSED.get(name, (name,)):
            with open(os.path.join(LUA_DIR, f"{part}.lua"), encoding="utf-8") as f:
                parts.append(f.read())
        body = "\n".join(parts)
        out[name] = used(preludes, body) + "\n" + body
    return out


def register(client):
    """{name: redis-py Script} on ``client`` (no round trip: each is sent on first use)."""
    return {name: client.register_script(source) for name, source in sources().items()}


def load(client, scripts):
    """Send every script to the server again (after it lost its script cache)."""
    for name, script in scripts.items():
        script.sha = client.script_load(sources()[name])
