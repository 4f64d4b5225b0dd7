"""`python benchmarks/fidelity.py` on an MLP given as a user's own workload (``--workload
FILE.py:FN``) with one plan of each kind: the Markdown table has one row per plan, every
estimated / XLA ratio and the jax.jit parity are finite and positive."""
import math
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PLANS = ["data_parallel", "manual_dp", "manual_fsdp"]


def test_fidelity_table(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
    out, model = tmp_path / "fidelity.md", tmp_path / "my_model.py"
    model.write_text("from __future__ import annotations\n\nimport dataclasses\n\nfrom automap import zoo\n\n\n"
                     "@dataclasses.dataclass(frozen=True)\nclass Sizes:  # a user's config class (needs the module "
                     "registered)\n    hidden: tuple[int, ...] = (256, 256)\n\n\ndef my_mlp():\n"
                     "    return zoo.mlp(zoo.MLPConfig(d_in=64, hidden=Sizes().hidden, d_out=64, batch=8))\n")
    run = subprocess.run([sys.executable, "benchmarks/fidelity.py", "--workload", f"{model}:my_mlp", "--plans",
                          ",".join(PLANS), "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = out.read_text().splitlines()
    assert "## my_mlp" in lines and "## mlp" not in lines and "## Summary" in lines
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines if line.startswith("| ")]
    head, body = rows[0], rows[1:]
    assert [r[0] for r in body] == PLANS
    for row in body:
        ratios = [float(c.strip("*")) for c, h in zip(row, head, strict=True) if h == "ratio"]  # bytes, memory, FLOPs
        assert len(ratios) == 3 and all(math.isfinite(r) and r > 0 for r in ratios), row
        parity = re.findall(r"[\d.]+", row[head.index("vs jax.jit sent / mem")])
        assert len(parity) == (2 if row[0].startswith("manual_") else 0), row
        assert all(math.isfinite(float(p)) and float(p) > 0 for p in parity), row
    summary = "\n".join(lines[lines.index("## Summary"):])
    assert "fidelity (3 plans" in summary and "jit parity (2 manual plans" in summary
