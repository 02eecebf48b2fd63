"""The chaos soak in CI: 2,000 jobs per broker under a seeded storm of faults.

A run takes well under a minute per broker on two cores. On failure the
assertion message carries the whole report and the seed; replay it with
``TANGGUH_CHAOS_SEED=<seed> pytest tests/chaos -k <broker>`` (same jobs, same
fault schedule; see ``engine.py`` for what a seed can and cannot fix). The
long run is ``python -m bench.chaos``.
"""
import os
import shutil

import pytest

from ..conftest import REQUIRE_SERVICES
from . import engine

JOBS = int(os.environ.get("TANGGUH_CHAOS_JOBS", "2000"))


def _needs(binary):
    if shutil.which(binary) is None and not any(os.path.exists(p) for p in (f"/usr/bin/{binary}",)):
        if REQUIRE_SERVICES:
            pytest.fail(f"TANGGUH_REQUIRE_SERVICES=1 but {binary} is not installed")
        pytest.skip(f"{binary} is not installed")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("broker", ["sqlite", "redis", "postgres"])
def test_chaos_soak(broker, tmp_path):
    if broker == "redis":
        _needs("redis-server")
    if broker == "postgres":
        from ..servers import _postgres_bin

        if _postgres_bin() is None:
            if REQUIRE_SERVICES:
                pytest.fail("TANGGUH_REQUIRE_SERVICES=1 but no PostgreSQL server binaries")
            pytest.skip("no PostgreSQL server binaries under /usr/lib/postgresql")
    seed = engine.seed_from_env()
    settings = engine.Settings(broker=broker, jobs=JOBS, seed=seed, duration=20.0, fault_interval=0.7,
                               quiesce_timeout=90.0, workdir=str(tmp_path / "soak"), keep=True)
    try:
        report = engine.Soak(settings).run()
    except BaseException as exc:
        raise AssertionError(f"chaos soak on {broker} crashed: {exc!r}; replay with TANGGUH_CHAOS_SEED={seed}") \
            from exc
    text = engine.format_report(report)
    print(text)
    log = "\n".join(f"  {t:6.2f} {kind} {detail}" for t, kind, detail in report["fault_log"])
    assert report["ok"], f"chaos soak failed on {broker}; replay with TANGGUH_CHAOS_SEED={seed}\n{text}\n" \
                         f"fault log:\n{log}"
    kinds = {"kill_child", "kill_supervisor", "term_supervisor", "hup_good", "hup_broken", "broker_outage",
             "stall_child", "stall_supervisor", "cancel", "pause"}
    missing = kinds - set(report["faults"])
    assert not missing, f"faults that never landed: {sorted(missing)} (seed {seed})\n{text}\nfault log:\n{log}"
