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


def test_multi_rank_producer_serves_one_decode_rank_from_two_prefill_ranks():
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "multi_rank_producer.py")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    # A TP2 -> TP1 fan-in moves what the one-rank quick start moves: every head and state shard once.
    assert "done 25681920 bytes from 2 prefill ranks" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert "Initialized NIXL agent" not in proc.stdout + proc.stderr  # quiet_nixl_logging took effect


def test_tiny_hybrid_parity_short_version():
    """P2 -> D4 in the interleaved layout decodes bit-identically; both negative controls fail as they must."""
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "tiny_hybrid_parity.py"), "--short"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-3000:]
    assert "interleaved P2 -> D4" in out and "logits 32/32 steps bit-equal  PASS" in out, out
    assert "refused with StatePositionError" in out and "step 0 logits differ" in out, out
    assert out.count("PASS") == 3 and "FAIL" not in out and out.rstrip().endswith("PARITY HOLDS"), out


SCRIPTS = ["quickstart.py", "layout_tour.py", "multi_rank_producer.py", "tiny_hybrid_parity.py"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_an_example_without_its_packages_says_in_one_line_what_to_run(script):
    """issue 21 row 3: `python examples/quickstart.py` outside .venv ended in a ModuleNotFoundError traceback.

    -I -S: this interpreter without its site-packages and without PYTHONPATH, as a bare `python` would be.
    """
    proc = subprocess.run([sys.executable, "-I", "-S", str(ROOT / "examples" / script)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert f"bash scripts/setup.sh && .venv/bin/python examples/{script}" in lines[0]
    assert "is not installed" in lines[0]


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_example_header_and_docs_say_venv_python(script):
    run = f".venv/bin/python examples/{script}"
    assert run in (ROOT / "examples" / script).read_text().split('"""')[1]  # the module docstring
    docs = (ROOT / "docs" / "examples.md").read_text()
    assert run in docs
    assert docs.count("python examples/") == docs.count(".venv/bin/python examples/")
