"""`python -m automap bench megatron --quick` (what CI runs): one row per (config, mesh, strategy),
the MoE rows, automap's ratio to the best expert present, the Markdown table (with what each
addition changes) and the plots written. Four search episodes: the test holds the rows, not the
search (the same figures as with the quick default of 16; notebook 02 runs 24)."""
import csv
import os
import subprocess
import sys

from automap import bench_megatron as bm

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_quick_benchmark(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
    out = subprocess.run([sys.executable, "-m", "automap", "bench", "megatron", "--quick", "--episodes", "4",
                          "--out", str(tmp_path)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    with open(tmp_path / "megatron_results.csv") as f:
        rows = list(csv.DictReader(f))
    keys = [(r["config"], r["mesh"], r["strategy"]) for r in rows]
    expected = [(c, m, s) for c in bm.QUICK_CONFIGS for m in bm.QUICK_MESHES for s in bm.STRATEGIES]
    expected += [(c, bm.MOE_MESH, s) for c in bm.QUICK_MOE for s in bm.MOE_STRATEGIES]
    assert sorted(keys) == sorted(expected)
    assert "vs_best_expert" in rows[0]
    for r in rows:
        if r["strategy"] == "automap_mcts":
            assert float(r["vs_best_expert"]) > 0
        elif r["strategy"] == "automap_ilp" and r["note"].startswith("n/a"):
            assert r["time_ms"] == ""  # no ILP solver, or the space is too large for it
        else:
            assert float(r["time_ms"]) > 0 and float(r["mem_gib"]) > 0
        if r["config"] in ("tiny",) + bm.QUICK_MOE and r["strategy"] in bm.EXPERTS + bm.MOE_EXPERTS:  # compiled
            assert r["xla_coll_mib"] != "" and float(r["xla_mem_gib"]) > 0
    table = (tmp_path / "megatron_results.md").read_text()
    assert "time / best expert" in table and "automap_mcts" in table
    # what each addition changes: sequence parallelism on both GPTs, expert parallelism and megatron on the MoE
    assert table.count("| sequence parallelism: megatron_dp -> megatron_dp_sp |") == 2
    assert table.count(" -> megatron_dp_sp_selective | ") == 2  # selective recompute, on both GPTs
    at = {(r["config"], r["mesh"], r["strategy"]): r for r in rows}
    for mesh in bm.QUICK_MESHES:  # the tiny model has no remat of its own: selective recompute holds less, by XLA
        sp, sel = at[("tiny", mesh, "megatron_dp_sp")], at[("tiny", mesh, "megatron_dp_sp_selective")]
        assert float(sel["xla_mem_gib"]) < float(sp["xla_mem_gib"]) and "GPT/blocks (selective)" in sel["note"]
    assert table.count(" | moe-tiny | ") == 2
    for name in ("memory", "collectives", "automap_vs_experts"):
        assert (tmp_path / f"megatron_{name}.png").stat().st_size > 1000
