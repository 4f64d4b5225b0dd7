"""plan.report(): optimizer state that mirrors its parameters and identical layers fold into one row."""
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import automap
import tactics
from automap.report import Row, collapse


def row(path, spec="(-)", shape=(4,), why="replicated"):
    return Row(path, shape, "float32", spec, 16, why)


@pytest.mark.parametrize("rows, want", [
    # Adam's mu and nu mirror the parameters: one line per state tree
    ([row("model/up/kernel", "(-, model)"), row("model/down/kernel"),
      row("opt/0/mu/up/kernel", "(-, model)"), row("opt/0/mu/down/kernel"),
      row("opt/0/nu/up/kernel", "(-, model)"), row("opt/0/nu/down/kernel")],
     ["model/up/kernel", "model/down/kernel", "opt/0/mu/...", "opt/0/nu/..."]),
    # a state leaf sharded unlike its parameter (ZeRO) stays a row of its own
    ([row("model/up/kernel"), row("model/down/kernel"),
      row("opt/mu/up/kernel", "(data)"), row("opt/mu/down/kernel"), row("opt/mu/x/kernel")],
     ["model/up/kernel", "model/down/kernel", "opt/mu/up/kernel", "opt/mu/down/kernel", "opt/mu/x/kernel"]),
    # identical layers fold; a layer that differs does not
    ([row(f"params/blocks_{i}/w", "(model)") for i in range(4)] + [row("params/blocks_0/b"), row("params/blocks_1/b", "(data)")],
     ["params/blocks_{0..3}/w", "params/blocks_0/b", "params/blocks_1/b"]),
    # list indices (nnx lists of layers) fold too; names ending in a digit without '_' do not
    ([row("model/layers/0/kernel"), row("model/layers/1/kernel"), row("model/fc1/kernel"), row("model/fc2/kernel")],
     ["model/layers/{0,1}/kernel", "model/fc1/kernel", "model/fc2/kernel"]),
])
def test_collapse_table(rows, want):
    assert [r[0] for r in collapse(rows)] == want


class Block(nnx.Module):
    def __init__(self, d, rngs):
        self.attn = nnx.MultiHeadAttention(2, d, decode=False, rngs=rngs)
        self.layers = nnx.List([nnx.Linear(d, d, rngs=rngs) for _ in range(3)])

    def __call__(self, x):
        x = self.attn(x)
        for layer in self.layers:
            x = x + layer(x)
        return x


def test_report_of_an_nnx_model_folds_adam_state_and_layers():
    model = Block(8, nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

    def step(model, optimizer, x):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    mesh = automap.make_mesh({"data": 2, "model": 4})
    f = automap.partition(step, mesh=mesh, tactics=[tactics.data_parallel("data"), tactics.megatron("model")])
    plan = f.plan(model, optimizer, jax.ShapeDtypeStruct((4, 6, 8), jnp.float32))
    short, full = plan.report(), plan.report(full=True)
    paths = [line.split()[0] for line in short.splitlines()[1:] if line.startswith("  ") and "/" in line.split()[0]]
    assert "optimizer/opt_state/0/mu/..." in paths and "optimizer/opt_state/0/nu/..." in paths
    assert "model/layers/{0..2}/kernel" in paths and "model/layers/1/kernel" not in paths
    assert not any("/mu/attn" in p for p in paths)
    assert "optimizer/opt_state/0/mu/attn/query/kernel" in full
    n_leaves = len(plan.program.inputs)
    assert f"{n_leaves} leaves in" in short and "leaves in" not in full


def test_command_line_help_lists_every_command_and_exits_0(capsys):
    from automap.__main__ import COMMANDS, main

    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {name} " in out for name in COMMANDS)
    assert main(["nonsense"]) == 2


def test_print_of_a_measurement_is_its_summary():
    from automap.measure import measure

    mesh = automap.make_mesh({"data": 8})
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    compiled = jax.jit(lambda x: x.sum(), in_shardings=sharding).lower(jnp.ones(64)).compile()
    m = measure(compiled)
    assert str(m) == m.summary() and "all-reduce" in str(m)
