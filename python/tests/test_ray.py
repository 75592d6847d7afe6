"""The Ray example with 2 actors on a local Ray cluster: episodes gathered from the actors equal
the same episodes run on one engine alone (the example exits non-zero otherwise)."""

import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples/ray_rollouts.py"


def test_ray_actors_reproduce_single_engine():
    run = subprocess.run([sys.executable, str(EXAMPLE), "--actors", "2", "--groups", "4", "--group-size", "3",
                          "--turns", "2", "--max-new", "8", "--rows", "6"],
                         capture_output=True, text=True, timeout=600)
    print(run.stdout)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "identical: all 12 episodes" in run.stdout
    assert run.stdout.count("episodes in") == 3  # two actors and the single engine
