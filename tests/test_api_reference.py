"""The API reference builds from the docstrings (what the README tells users to run)."""
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("pdoc")
ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_api_reference_builds_with_every_public_module(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "pdoc", "automap", "tactics", "search", "-o", str(tmp_path)],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    pages = {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.html")}
    assert {"automap.html", "tactics.html", "search.html", "automap/measure.html", "tactics/megatron.html"} <= pages
    top = (tmp_path / "automap.html").read_text()
    assert all(name in top for name in ("make_mesh", "partition", "Plan", "measure", "Topology"))
