"""The long chaos soak from the command line.

    python -m bench.chaos --broker sqlite|redis|postgres --jobs 100000 --seed 7 --duration 600

Runs the same engine as ``tests/chaos`` (see ``tests/chaos/engine.py``) with
more jobs and a longer fault window, prints the report, and with ``--json``
also writes it as JSON. Exit status 0 when every invariant held.
"""
import argparse
import json
import sys

from tests.chaos import engine


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.splitlines()[0])
    p.add_argument("--broker", choices=("sqlite", "redis", "postgres"), default="sqlite")
    p.add_argument("--jobs", type=int, default=100_000)
    p.add_argument("--seed", type=int, default=None, help="default: TANGGUH_CHAOS_SEED, else random")
    p.add_argument("--duration", type=float, default=None,
                   help="seconds of fault injection (default: about as long as the jobs take, jobs / 100)")
    p.add_argument("--enqueue-seconds", type=float, default=None,
                   help="spread the enqueues over this many seconds (default: 60%% of --duration)")
    p.add_argument("--fault-interval", type=float, default=2.0, help="mean seconds between faults")
    p.add_argument("--supervisors", type=int, default=2)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--quiesce-timeout", type=float, default=600.0)
    p.add_argument("--workdir", default=None, help="keep logs and databases here")
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    a = p.parse_args(argv)
    seed = a.seed if a.seed is not None else engine.seed_from_env()
    duration = a.duration if a.duration is not None else max(20.0, a.jobs / 100)
    settings = engine.Settings(broker=a.broker, jobs=a.jobs, seed=seed, duration=duration,
                               enqueue_seconds=a.enqueue_seconds, fault_interval=a.fault_interval,
                               supervisors=a.supervisors, workers=a.workers, quiesce_timeout=a.quiesce_timeout,
                               workdir=a.workdir, keep=a.workdir is not None)
    print(f"chaos soak: broker={a.broker} jobs={a.jobs} seed={seed} faults for {duration:.0f}s", flush=True)
    report = engine.Soak(settings).run()
    print(engine.format_report(report))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
