"""The examples the README points at must keep running."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("script", ["layout_tour.py"])
def test_example_runs(script):
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / script)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_quickstart_moves_the_request():
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "quickstart.py")], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert "done 25681920 bytes" in proc.stdout, proc.stdout + proc.stderr[-2000:]
