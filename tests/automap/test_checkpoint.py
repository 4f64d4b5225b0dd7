"""automap.checkpoint: save sharded train state with orbax, restore it straight onto a plan's
shardings (the same mesh, or another mesh shape after replanning), training goes on identically."""
import re

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import automap
import tactics
from automap import checkpoint, zoo

W = zoo.mlp(zoo.MLPConfig(d_in=16, hidden=(32,), d_out=8, batch=8))
TP_DP = [tactics.megatron("model"), tactics.data_parallel("data")]
MESHES = {
    "2x4": ({"data": 2, "model": 4}, TP_DP),
    "4x2": ({"data": 4, "model": 2}, TP_DP),
    "8": ({"data": 8}, None),
}


def raises(exc, *fragments):
    return pytest.raises(exc, match="(?s)" + "".join(f"(?=.*{re.escape(f)})" for f in fragments))


BATCHES = [W.init(i)[1] for i in range(4)]


def batch(i):
    return BATCHES[i]


def stepper(name):
    axes, tacts = MESHES[name]
    return automap.automap(W.train_step, mesh=automap.make_mesh(axes), tactics=tacts)


@pytest.fixture(scope="module")
def reference():
    """Four steps on the 2x4 mesh without interruption; the state after step 2."""
    step = stepper("2x4")
    state, _ = W.init(0)
    losses, after2 = [], None
    for i in range(4):
        state, loss = step(state, batch(i))
        losses.append(float(loss))
        if i == 1:
            after2 = state
    return step, after2, losses


@pytest.mark.parametrize("mesh", list(MESHES))
def test_restore_onto_a_plan_and_train_on(tmp_path, reference, mesh):
    step, after2, losses = reference
    path = tmp_path / "ckpt"
    checkpoint.save(path, after2, step.plan(after2, batch(0)))

    new_step = step if mesh == "2x4" else stepper(mesh)
    plan = new_step.plan(after2, batch(0))
    state = checkpoint.restore(path, plan)
    # directly on the plan's shardings (the state argument found by its leaf paths)
    got, want = jax.tree.leaves(state), jax.tree.leaves(plan.in_shardings[0])
    assert [a.sharding for a in got] == want
    if mesh != "8":
        assert any(s.spec != P() for s in want)  # the parameters really are sharded
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), state, after2)
    for i in (2, 3):
        state, loss = new_step(state, batch(i))
        np.testing.assert_allclose(float(loss), losses[i], rtol=1e-5)


def test_restore_onto_shardings(tmp_path, reference):
    _, after2, _ = reference
    path = tmp_path / "ckpt"
    checkpoint.save(path, after2)  # no plan: saved as it is
    mesh = automap.make_mesh({"data": 8})
    replicated = NamedSharding(mesh, P())
    state = checkpoint.restore(path, replicated)
    assert all(a.sharding == replicated for a in jax.tree.leaves(state))
    split = jax.tree.map(lambda a: NamedSharding(mesh, P("data") if a.ndim and a.shape[0] % 8 == 0 else P()), after2)
    state = checkpoint.restore(path, split)
    assert [a.sharding for a in jax.tree.leaves(state)] == jax.tree.leaves(split)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), state, after2)


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(16, 32, rngs=rngs)
        self.l2 = nnx.Linear(32, 8, rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.relu(self.l1(x)))


def nnx_step(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(lambda m: ((m(batch["x"]) - batch["y"]) ** 2).mean())(model)
    optimizer.update(model, grads)
    return loss


def test_nnx_objects_onto_another_mesh(tmp_path):
    def objects():
        model = MLP(nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)

    manual = [tactics.manual({r"^model/l1/kernel$": P(None, "model")}), tactics.data_parallel("data")]
    first = automap.automap(nnx_step, mesh=automap.make_mesh({"data": 2, "model": 4}), tactics=manual)
    model, optimizer = objects()
    losses = [float(first(model, optimizer, batch(i))) for i in range(2)]
    path = tmp_path / "ckpt"
    checkpoint.save(path, {"model": model, "optimizer": optimizer}, first.plan(model, optimizer, batch(0)))
    losses += [float(first(model, optimizer, batch(i))) for i in (2, 3)]

    second = automap.automap(nnx_step, mesh=automap.make_mesh({"data": 4, "model": 2}), tactics=manual)
    model2, optimizer2 = objects()
    plan = second.plan(model2, optimizer2, batch(0))
    restored = checkpoint.restore(path, plan)  # {"model": ..., "optimizer": ...}: two arguments by name
    assert restored["model"]["l1"]["kernel"].sharding == plan.in_shardings[0]["l1"]["kernel"]
    assert plan.in_shardings[0]["l1"]["kernel"].spec == P(None, "model")
    nnx.update(model2, restored["model"])
    nnx.update(optimizer2, restored["optimizer"])
    for i in (2, 3):
        np.testing.assert_allclose(float(second(model2, optimizer2, batch(i))), losses[i], rtol=1e-5)
    assert int(optimizer2.step[...]) == 4


# ---------------------------------------------------------------------------- errors

def test_restore_onto_a_plan_for_other_sizes(tmp_path, reference):
    step, after2, _ = reference
    checkpoint.save(tmp_path / "ckpt", after2)
    wide = zoo.mlp(zoo.MLPConfig(d_in=16, hidden=(64,), d_out=8, batch=8))
    plan = automap.partition(wide.train_step, mesh=step.mesh).plan(*wide.abstract())
    with raises(ValueError, "9 leaves differ", "plan's 'state'", "'opt_state/1/0/mu/layers_0/bias' is float32[32] in the "
                "checkpoint, float32[64] in the plan", "'opt_state/1/0/mu/layers_0/kernel' is float32[16, 32] in the "
                "checkpoint, float32[16, 64]", "(and 5 more)", "same model sizes"):
        checkpoint.restore(tmp_path / "ckpt", plan)


def test_a_checkpoint_that_is_no_argument_of_the_plan(tmp_path, reference):
    step, after2, _ = reference
    checkpoint.save(tmp_path / "ckpt", {"weights": after2["params"]})
    with raises(ValueError, "no argument of the plan (state, batch)", "'state'", "weights/layers_0/bias", "arg="):
        checkpoint.restore(tmp_path / "ckpt", step.plan(after2, batch(0)))
    with raises(ValueError, "no argument of the plan"):
        checkpoint.save(tmp_path / "other", {"weights": after2["params"]}, step.plan(after2, batch(0)))


def test_several_matching_arguments_need_arg(tmp_path):
    def ema_step(params, ema, x):
        new = jax.tree.map(lambda p: p - 0.1 * (x @ p).sum(), params)
        return new, jax.tree.map(lambda e, p: 0.9 * e + 0.1 * p, ema, new)

    params = {"w": np.ones((4, 4), np.float32)}
    f = automap.partition(ema_step, mesh=automap.make_mesh({"data": 8}))
    plan = f.plan(params, params, np.ones((8, 4), np.float32))
    checkpoint.save(tmp_path / "ckpt", params)
    with raises(ValueError, "match several arguments", "params", "ema", "pass arg="):
        checkpoint.restore(tmp_path / "ckpt", plan)
    assert set(checkpoint.restore(tmp_path / "ckpt", plan, arg="ema")) == {"w"}
    with raises(ValueError, "arg='emma' is not an argument", "['params', 'ema', 'x']"):
        checkpoint.restore(tmp_path / "ckpt", plan, arg="emma")
