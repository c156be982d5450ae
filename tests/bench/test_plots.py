"""--plot: real PNGs from a small simulation, and one clear line when the optional matplotlib is missing."""

from __future__ import annotations

import subprocess
import sys

SIM = ["-m", "warmroute", "simulate", "--workload", "shared", "--instances", "2", "--requests", "200",
       "--rate", "4", "--strategies", "random,cache_aware"]


def test_simulate_writes_the_plots(tmp_path):
    done = subprocess.run([sys.executable, *SIM, "--plot", str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    pngs = sorted(tmp_path.glob("*.png"))
    assert pngs and all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 1000 for p in pngs)


def test_plot_without_matplotlib_is_one_line_and_exit_2(tmp_path):
    # A None entry in sys.modules makes `import matplotlib` fail, as it would where it is not installed.
    code = ("import sys; sys.modules['matplotlib'] = None; from warmroute.cli import main; "
            f"sys.exit(main({SIM[2:] + ['--plot', str(tmp_path)]!r}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "pip install 'warmroute[plot]'" in done.stderr
    assert not list(tmp_path.iterdir())  # nothing simulated or written first
