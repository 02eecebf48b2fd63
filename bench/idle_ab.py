"""An idle daemon of two revisions, side by side, rounds interleaved: latency and memory.

    python -m bench.idle_ab REV [--against REV2] [--broker sqlite,redis,postgres] [--rounds 6]
                                [--samples 40] [--json FILE]

What ``python -m bench`` measures of a daemon with nothing to do, as an A/B:
scenario 7 (idle PSS and RSS of the master and its 2 children, 2 s after 4
warm-up jobs) then scenario 4 (enqueue -> start of one job at a time, the queue
idle 100-300 ms between jobs), on one daemon start per side and round. ``REV``
is checked out into a temporary git worktree; ``--against`` defaults to the
working tree. As in ``bench.throughput_ab``, only the daemon differs between
the sides (it imports ``supervisor`` from its side's tree; the harness, the
enqueuing client and the job body are this tree's), and the sides alternate
round by round (ABBA), so the load of a shared machine falls on both alike.

Prints a Markdown table per broker: each side's median p50 and p99 latency (ms)
and idle PSS (MiB), B / A of the medians and the per-round range of B / A.
"""
import argparse
import json
import statistics
import sys
import time

from bench import run
from bench.throughput_ab import BROKERS, daemon
from bench.trees import ab_rounds, broker_list

MEASURES = (("latency p50 ms", "p50_ms", 2), ("latency p99 ms", "p99_ms", 2), ("idle PSS MiB", "pss_mib", 1))


def one_round(fw, ev, settings):
    """{p50_ms, p99_ms, pss_mib, rss_mib} of one daemon start."""
    fw.reset()
    try:
        run.warm_up(fw, ev)
        figures = run.scenario_memory(fw, ev, settings)
        figures.update(run.scenario_latency(fw, ev, settings))
    finally:
        fw.stop()
        fw.cleanup()
    if figures.get("p50_ms") is None:
        raise SystemExit(f"{fw.name}: no latency measured ({figures})")
    return figures


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.idle_ab", description=__doc__.splitlines()[0])
    p.add_argument("rev", help="the revision to compare (e.g. the commit before a change)")
    p.add_argument("--against", default=None, help="the other revision (default: the working tree)")
    p.add_argument("--broker", default=",".join(BROKERS), help="comma-separated, of sqlite, redis, postgres")
    p.add_argument("--rounds", type=int, default=6, help="rounds per broker (each starts both sides)")
    p.add_argument("--samples", type=int, default=40, help="latency samples per start (python -m bench: 40)")
    p.add_argument("--json", help="write every figure to this file")
    args = p.parse_args(argv)
    brokers = broker_list(p, args.broker, BROKERS)
    if args.rounds < 1 or args.samples < 1:
        p.error("--rounds and --samples must be at least 1")
    settings = run.Settings(quick=False)
    settings.latency_samples = args.samples
    ev = run.Evidence()
    rounds = []
    for trees, figures, sides, tmp in ab_rounds({"A": args.rev, "B": args.against}, "idle-ab", brokers,
                                                args.rounds, ev):
        for side in sides:
            figures[side] = one_round(daemon(tmp, figures["broker"], trees[side][0]), ev, settings)
        rounds.append(figures)
        a, b = figures["A"], figures["B"]
        print(f"  {figures['broker']} round {figures['round']}: p50 A {a['p50_ms']} B {b['p50_ms']} ms,"
              f" PSS A {a['pss_mib']} B {b['pss_mib']} MiB  (load {figures['loadavg']:.1f})", file=sys.stderr,
              flush=True)
        if args.json:  # after every round: an interrupted run keeps what it measured
            with open(args.json, "w") as f:
                json.dump({"written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                           "A": trees["A"][1], "B": trees["B"][1], "samples": args.samples,
                           "machine": run.machine(), "rounds": rounds}, f, indent=2)
                f.write("\n")
    print(f"A = {trees['A'][1]}, B = {trees['B'][1]}; {args.rounds} daemon starts per side and broker,"
          f" {args.samples} latency samples each\n")
    print("| broker | measure | A median | B median | B / A (medians) | B / A per round: min – max | rounds |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for broker in brokers:
        mine = [f for f in rounds if f["broker"] == broker]
        for measure, key, digits in MEASURES:
            a, b = statistics.median(f["A"][key] for f in mine), statistics.median(f["B"][key] for f in mine)
            ratios = [f["B"][key] / f["A"][key] for f in mine]
            print(f"| {broker} | {measure} | {a:.{digits}f} | {b:.{digits}f} | {b / a:.2f} | {min(ratios):.2f} – {max(ratios):.2f}"
                  f" | {len(mine)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
