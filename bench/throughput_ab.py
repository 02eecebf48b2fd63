"""The daemon's no-op throughput of two revisions, side by side, rounds interleaved.

    python -m bench.throughput_ab REV [--against REV2] [--broker sqlite,redis,postgres] [--rounds 8]
                                      [--jobs 10000] [--json FILE] [--b-set SECTION.KEY=VALUE ...]

Each round is scenario 1 of ``python -m bench`` (``scenario_throughput`` in
bench/run.py, reused as it is): N no-op jobs enqueued, then a Tangguh daemon of
2 workers started; jobs/s from the first execution's start to the last one's
end, as the job body records them. ``REV`` is checked out into a temporary git
worktree; ``--against`` defaults to the working tree. Only the daemon differs
between the sides: it imports its ``supervisor`` package from its side's tree
(first on its PYTHONPATH); the harness, the job body, the enqueuing client and
the settings are this tree's for both. Per broker the sides alternate round by
round (ABBA), so the load of a shared machine falls on both alike: on a shared
machine compare the ratios, not the absolute figures.

Prints a Markdown table: per broker, each side's median, B / A of the medians
and the range of B / A over the rounds (each round runs A and B back to back),
for the jobs/s and for the master's CPU per job (user + system, start-up
included; less sensitive to other load than wall time); on Redis also the
script calls per 1,000 jobs (``INFO commandstats``, the enqueue's included): a
count, not a time, so the noise of a shared machine does not blur it, though
another client of the same server running scripts meanwhile would. ``--json``
writes every figure after every round. ``--b-set SECTION.KEY=VALUE`` gives side B
a config setting of its own: with ``--against`` naming A's revision, the A/B is
of that setting, on one tree.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import tomllib

import psutil
import redis

from bench import run
from bench.trees import ab_rounds, broker_list

BROKERS = ("sqlite", "redis", "postgres")


class Tangguh(run.Tangguh):
    """bench/run.py's Tangguh, noting its master's CPU seconds (start-up included) just before the stop,
    its broker migrated by its side's code."""

    master_cpu = None

    def migrate(self):
        # The daemon's own tree makes the tables: a daemon refuses a schema newer than its code.
        subprocess.run([run.PY, "-c", "import sys; from supervisor.backends import open_broker;"
                        " b = open_broker(sys.argv[1]); b.migrate(); b.close()", self.url],
                       env=self.env, cwd=self.tmp, check=True)

    def stop(self, *args, **kwargs):
        try:
            cpu = psutil.Process(self.procs[0].pid).cpu_times()
            self.master_cpu = cpu.user + cpu.system
        except (IndexError, psutil.Error):
            pass
        super().stop(*args, **kwargs)


def daemon(tmp, broker, tree):
    """A Tangguh framework of bench/run.py whose daemon imports ``supervisor`` from ``tree``."""
    fw = Tangguh(tmp, broker)
    fw.env["PYTHONPATH"] = tree + os.pathsep + fw.env["PYTHONPATH"]
    # Guard against measuring one tree twice (an installed package shadowing the path, say).
    where = subprocess.run([run.PY, "-c", "import supervisor; print(supervisor.__file__)"], env=fw.env,
                           cwd=tmp, capture_output=True, text=True, check=True).stdout.strip()
    if not where.startswith(os.path.join(tree, "supervisor") + os.sep):
        raise SystemExit(f"the daemon would import {where}, not the package of {tree}")
    return fw


def script_calls():
    """Script calls the bench's Redis server has run since it started (``EVALSHA`` and ``EVAL``)."""
    stats = redis.Redis.from_url(run.REDIS).info("commandstats")
    return sum(stats.get(f"cmdstat_{name}", {}).get("calls", 0) for name in ("evalsha", "eval"))


def one_round(fw, ev, settings):
    """(jobs/s, the master's CPU µs per job, script calls per 1,000 jobs or None, whether every
    job ran within the scenario's bound) of one run.

    As in ``python -m bench``, a run cut off by the bound is measured on what it ran."""
    before = script_calls() if fw.broker == "redis" else None
    try:
        result = run.scenario_throughput(fw, ev, settings)
    finally:
        fw.cleanup()
    if not result.get("jobs_per_s") or fw.master_cpu is None:
        raise SystemExit(f"{fw.name}: no measure ({result}; master CPU {fw.master_cpu})")
    calls = None if before is None else round((script_calls() - before) * 1000 / result["jobs"], 1)
    return (result["jobs_per_s"], round(fw.master_cpu * 1e6 / result["jobs"]), calls,
            bool(result.get("complete")))


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.throughput_ab", description=__doc__.splitlines()[0])
    p.add_argument("rev", help="the revision to compare (e.g. the commit before a change)")
    p.add_argument("--against", default=None, help="the other revision (default: the working tree)")
    p.add_argument("--broker", default=",".join(BROKERS), help="comma-separated, of sqlite, redis, postgres")
    p.add_argument("--rounds", type=int, default=8, help="rounds per broker (each runs both sides)")
    p.add_argument("--jobs", type=int, default=10_000, help="no-op jobs per run (default 10,000, as python -m bench)")
    p.add_argument("--json", help="write every figure to this file")
    p.add_argument("--prefetch", type=int, default=None,
                   help="pin broker.prefetch on both sides (default: each side's config default)")
    p.add_argument("--b-set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="a config setting for side B only (a TOML value: --b-set 'supervisor.cpu_affinity=\"spread\"');"
                        " with --against A's revision, an A/B of a setting")
    args = p.parse_args(argv)
    brokers = broker_list(p, args.broker, BROKERS)
    b_config = settings_of(p, args.b_set)
    if args.rounds < 1 or args.jobs < 2:
        p.error("--rounds must be at least 1 and --jobs at least 2")
    run.Tangguh.prefetch = args.prefetch
    settings = run.Settings(quick=False)
    settings.noop_jobs = args.jobs
    ev = run.Evidence()
    rounds = []
    for trees, figures, sides, tmp in ab_rounds({"A": args.rev, "B": args.against}, "throughput-ab", brokers,
                                                args.rounds, ev):
        for side in sides:
            fw = daemon(tmp, figures["broker"], trees[side][0])
            if side == "B":
                fw.extra["config"] = b_config
            figures[side], figures[f"{side}_cpu_us"], calls, complete = one_round(fw, ev, settings)
            if calls is not None:
                figures[f"{side}_calls_per_1000"] = calls
            if not complete:
                figures.setdefault("cut_off", []).append(side)
        rounds.append(figures)
        cut = f"  cut off: {', '.join(figures['cut_off'])}" if "cut_off" in figures else ""
        calls = (f", scripts {figures['A_calls_per_1000']} / {figures['B_calls_per_1000']} per 1,000 jobs"
                 if "A_calls_per_1000" in figures else "")
        print(f"  {figures['broker']} round {figures['round']}: A {figures['A']:,.0f}  B {figures['B']:,.0f} jobs/s,"
              f" master {figures['A_cpu_us']} / {figures['B_cpu_us']} µs/job{calls}"
              f"  (load {figures['loadavg']:.1f}){cut}",
              file=sys.stderr, flush=True)
        if args.json:  # after every round: an interrupted run keeps what it measured
            write_json(args.json, trees, args.jobs, rounds, b_config)
    print(f"A = {trees['A'][1]}, B = {trees['B'][1]}{'' if not b_config else f' with {b_config}'};"
          f" {args.rounds} rounds of {args.jobs:,} no-ops per broker\n")
    print("| broker | measure | A median | B median | B / A (medians) | B / A per round: min – max | rounds |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for broker in brokers:
        mine = [f for f in rounds if f["broker"] == broker]
        for measure, a_key, b_key in (("jobs/s", "A", "B"), ("master CPU µs/job", "A_cpu_us", "B_cpu_us"),
                                      ("script calls per 1,000 jobs", "A_calls_per_1000", "B_calls_per_1000")):
            if a_key not in mine[0]:
                continue  # calls: Redis only
            a, b = statistics.median(f[a_key] for f in mine), statistics.median(f[b_key] for f in mine)
            ratios = [f[b_key] / f[a_key] for f in mine]
            print(f"| {broker} | {measure} | {a:,.0f} | {b:,.0f} | {b / a:.2f} | {min(ratios):.2f} – {max(ratios):.2f}"
                  f" | {len(mine)} |")
    cut = sum(len(f.get("cut_off", ())) for f in rounds)
    if cut:
        print(f"\n{cut} run(s) cut off by the {settings.throughput_budget + 5:.0f} s bound, measured on what they ran")
    return 0


def settings_of(parser, items):
    """``["section.key=<TOML value>", ...]`` as ``{section: {key: value}}``."""
    out = {}
    for item in items:
        name, _, value = item.partition("=")
        section, _, key = name.partition(".")
        try:
            out.setdefault(section, {})[key] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError as exc:
            parser.error(f"--b-set {item!r}: the value is no TOML value ({exc})")
        if not (section and key):
            parser.error(f"--b-set {item!r}: expected SECTION.KEY=VALUE")
    return out


def write_json(path, trees, jobs, rounds, b_config=None):
    with open(path, "w") as f:
        json.dump({"written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "A": trees["A"][1], "B": trees["B"][1],
                   "b_config": b_config or {}, "jobs": jobs, "machine": run.machine(), "rounds": rounds}, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    sys.exit(main())
