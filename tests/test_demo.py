"""``tangguh demo`` on a fresh install: the newcomer's tour must work and tell the truth."""
import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

from .daemon import tangguh

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_demo_tours_every_outcome_and_exits_zero():
    out = tangguh("demo", timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    assert "SIGKILLed child" in text
    assert "flaky             done on attempt 3, after 2 retries" in text
    assert "always_permanent  dead-lettered after 1 attempt(s): permanent" in text
    assert "sleep             done on attempt 2: recovered after its child was killed" in text
    assert "no_such_type      dead-lettered after 1 attempt(s): unknown_type" in text
    assert "restarts: 1" in text
    assert "exit code 0" in text


def test_unknown_demo_name_is_a_one_line_error():
    out = tangguh("demo", "nonsense")
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "unknown demo" in out.stderr


@pytest.mark.slow
def test_both_demos_run_from_an_installed_wheel(tmp_path, redis_url):
    """A normal install (pip install /path/to/tangguh, a package index): no source checkout to lean on."""
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", "*.db", "bench"))
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", str(source), "-w",
                            str(tmp_path / "dist")], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = (tmp_path / "dist").glob("tangguh-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    installed = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
                                "--no-index", "-q", str(wheel)], capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    # The dependencies come from this venv by a plain path entry: not a site dir, so the
    # editable install's finder there is not loaded and `supervisor` is the wheel's.
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(site, "deps.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    where = subprocess.run([str(python), "-c", "import supervisor; print(supervisor.__file__)"], cwd=elsewhere,
                           env=env, capture_output=True, text=True, check=True).stdout
    assert where.startswith(site), where

    tangguh = str(venv / "bin" / "tangguh")
    out = subprocess.run([tangguh, "demo"], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "no_such_type      dead-lettered after 1 attempt(s): unknown_type" in out.stdout
    out = subprocess.run([tangguh, "demo", "invoices", "--redis-url", redis_url], cwd=elsewhere, env=env,
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
