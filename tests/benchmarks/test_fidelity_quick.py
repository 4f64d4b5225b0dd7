"""`python benchmarks/fidelity.py` on an MLP given as a user's own workload (``--workload
FILE.py:FN``) on another mesh (``--mesh 4x2``) with one plan of each kind: the Markdown table has one row per plan, every
estimated / XLA ratio and the jax.jit parity are finite and positive."""
import math
import os
import re
import subprocess
import sys

from bench_module import load

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
                          ",".join(PLANS), "--mesh", "4x2", "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = out.read_text().splitlines()
    assert "(mesh data=4 x model=2, 8 simulated CPU devices)" in lines[2]
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


def test_manual_plans_of_an_optimizer_with_factored_state():
    """Adafactor keeps a row and a column vector per matrix (and a (1,) placeholder per factored
    leaf): the manual plans give a parameter's spec only to the state leaves of its shape, and
    automap plans them (a rank-2 spec on a vector was a ShardingError)."""
    import dataclasses

    import jax
    import optax

    import automap
    import tactics
    from automap import zoo

    bench = load("fidelity")
    mlp = zoo.mlp(zoo.MLPConfig(d_in=32, hidden=(64,), d_out=32, batch=8))
    optimizer = optax.adafactor(1e-3, min_dim_size_to_factor=16)
    params, batch = mlp.abstract()[0]["params"], mlp.abstract()[1]
    state = {"params": params, "opt_state": jax.eval_shape(optimizer.init, params)}
    w = dataclasses.replace(mlp, abstract=lambda: (state, batch))

    def step(state, batch):
        grads = jax.grad(mlp.loss_fn)(state["params"], batch)
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}

    rules = bench.manual_rules("adafactor_mlp", w, automap.make_mesh(bench.MESH))["manual_fsdp"]
    plan = automap.automap(step, mesh=automap.make_mesh(bench.MESH), tactics=[tactics.manual(rules)],
                           search=None).plan(state, batch)
    flat = jax.tree_util.tree_flatten_with_path(plan.in_shardings[0], is_leaf=lambda s: hasattr(s, "spec"))[0]
    specs = {jax.tree_util.keystr(p): tuple(s.spec) for p, s in flat}
    kernel = [k for k in specs if k.startswith("['params']") and k.endswith("['kernel']")][0]
    assert specs[kernel] == (None, ("data", "model")) or specs[kernel] == (("data", "model"), None)
    moments = {k: v for k, v in specs.items() if k.startswith("['opt_state']") and kernel[len("['params']"):] in k}
    assert moments and all(v == () or v == (None,) for v in moments.values()), moments
