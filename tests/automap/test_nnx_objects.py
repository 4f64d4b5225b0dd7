"""flax nnx objects as arguments: a train step mutating a model and an nnx.Optimizer is planned as a
pure function of their state, matches nnx.jit, and leaves the objects sharded per plan."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import automap
import tactics
from automap import zoo
from automap.zoo.gpt_nnx import GPT

MESH = automap.make_mesh({"data": 2, "model": 4})


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(16, 32, rngs=rngs)
        self.l2 = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.relu(self.l1(x)))


def train_step(model, optimizer, batch):
    def loss_fn(model):
        return ((model(batch["x"]) - batch["y"]) ** 2).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def gpt_step(model, optimizer, batch):
    def loss_fn(model):
        logits = model(batch["tokens"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def mlp_objects():
    model = MLP(nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)


GPT_CFG = zoo.GPTConfig(layers=1, d_model=32, heads=4, vocab=64, seq=16, batch=8)


def gpt_objects():
    model = GPT(GPT_CFG, rngs=nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)


def mlp_batch(seed=0):
    rs = np.random.RandomState(seed)
    return {"x": rs.randn(8, 16).astype(np.float32), "y": rs.randn(8, 4).astype(np.float32)}


def gpt_batch(seed=0):
    rs = np.random.RandomState(seed)
    return {"tokens": rs.randint(0, 64, (8, 16)).astype(np.int32), "targets": rs.randint(0, 64, (8, 16)).astype(np.int32)}


def state_of(*objects):
    return nnx.to_pure_dict(nnx.state(objects))


MLP_TACTICS = [tactics.manual({r"^model/l1/kernel$": P(None, "model")}), tactics.data_parallel("data")]
GPT_TACTICS = [tactics.megatron("model"), tactics.data_parallel("data")]


@pytest.mark.parametrize("objects, step, batch, tacts", [
    (mlp_objects, train_step, mlp_batch, MLP_TACTICS),
    (gpt_objects, gpt_step, gpt_batch, GPT_TACTICS),
], ids=["mlp", "gpt_nnx"])
def test_matches_nnx_jit_and_stays_sharded(objects, step, batch, tacts, monkeypatch):
    model, optimizer = objects()
    ref_model, ref_optimizer = objects()
    f = automap.automap(step, mesh=MESH, tactics=tacts)
    ref = nnx.jit(step)
    plan = f.plan(model, optimizer, batch())
    want_shardings = jax.tree.leaves(plan.in_shardings[:2])
    assert any(s.spec != P() for s in want_shardings)  # something is really sharded
    puts = []
    real_put = jax.device_put
    for i in range(3):
        if i == 2:  # by now the state is on the plan's shardings: only the (numpy) batch is placed
            monkeypatch.setattr(jax, "device_put", lambda x, s, *a, **k: puts.append(x) or real_put(x, s, *a, **k))
        loss = f(model, optimizer, batch(i))
        want = ref(ref_model, ref_optimizer, batch(i))
        np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)
        got = jax.tree.leaves(state_of(model, optimizer))
        assert [a.sharding for a in got] == want_shardings, f"step {i}"
    assert len(puts) == 2
    # (Adam amplifies float noise in tiny gradients: the parameters agree to 1e-4 after 3 steps)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4),
                 state_of(model), state_of(ref_model))
    assert int(optimizer.step[...]) == 3
    assert f.plan(model, optimizer, batch()) is plan  # the same structure: the same plan


def test_paths_name_the_arguments_and_attributes():
    model, optimizer = mlp_objects()
    plan = automap.partition(train_step, mesh=MESH, tactics=MLP_TACTICS).plan(model, optimizer, mlp_batch())
    paths = plan.program.input_paths
    assert paths[:4] == ("model/l1/bias", "model/l1/kernel", "model/l2/bias", "model/l2/kernel")
    assert "optimizer/step" in paths and "optimizer/opt_state/0/mu/l1/kernel" in paths
    assert paths[-2:] == ("batch/x", "batch/y")
    # the manual rule matched model/l1/kernel: its optimizer moments follow
    model_s, optimizer_s, batch_s = plan.in_shardings
    assert model_s["l1"]["kernel"].spec == P(None, "model")
    assert optimizer_s["opt_state"][0]["mu"]["l1"]["kernel"].spec == P(None, "model")
    assert batch_s["x"].spec == P("data")
    # the new state of each object is an output, fed back on the same shardings
    new_model_s, new_optimizer_s, loss_s = plan.out_shardings
    assert new_model_s == model_s and new_optimizer_s == optimizer_s and loss_s.spec == P()
    assert "model/l1/kernel" in plan.report()


def test_lower_accepts_objects_and_abstract_batches():
    model, optimizer = mlp_objects()
    f = automap.partition(train_step, mesh=MESH, tactics=MLP_TACTICS)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), mlp_batch())
    lowered = f.lower(model, optimizer, abstract)
    assert isinstance(lowered, jax.stages.Lowered)
    assert lowered.as_text() == f.lower(model, optimizer, mlp_batch()).as_text()
    assert float(model.l2.bias[...].sum()) == 0.0  # planning and lowering mutate nothing


def test_objects_inside_a_container_argument():
    def step(state, batch):
        return train_step(state["model"], state["optimizer"], batch)

    model, optimizer = mlp_objects()
    ref_model, ref_optimizer = mlp_objects()
    f = automap.partition(step, mesh=MESH)
    for i in range(2):
        loss = f({"model": model, "optimizer": optimizer}, mlp_batch(i))
        want = nnx.jit(train_step)(ref_model, ref_optimizer, mlp_batch(i))
        np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)
    assert "state/model/l1/kernel" in f.plan({"model": model, "optimizer": optimizer}, mlp_batch()).program.input_paths


def test_a_stored_plan_works_for_objects(tmp_path):
    model, optimizer = mlp_objects()
    plan = automap.partition(train_step, mesh=MESH, tactics=MLP_TACTICS).plan(model, optimizer, mlp_batch())
    plan.save(tmp_path / "plan.json")
    f = automap.automap(train_step, mesh=MESH, plan=str(tmp_path / "plan.json"))
    assert f.plan(model, optimizer, mlp_batch()).in_shardings == plan.in_shardings
    f(model, optimizer, mlp_batch())
    assert model.l1.kernel[...].sharding == plan.in_shardings[0]["l1"]["kernel"]
    # fresh objects (another optax transformation too): the same program, the stored plan fits
    loaded = automap.Plan.load(tmp_path / "plan.json", MESH, train_step, (*mlp_objects(), mlp_batch()))
    assert loaded.in_shardings == plan.in_shardings and loaded.program.input_paths == plan.program.input_paths


def test_new_objects_of_the_same_structure_reuse_the_plan():
    tx = optax.adamw(1e-2)
    f = automap.partition(train_step, mesh=MESH)
    plans = []
    for seed in (0, 1):
        model = MLP(nnx.Rngs(seed))
        plans.append(f.plan(model, nnx.Optimizer(model, tx, wrt=nnx.Param), mlp_batch()))
    assert plans[0] is plans[1]


def test_a_step_that_adds_a_variable_is_an_error():
    def step(model, x):
        model.extra = nnx.Param(jnp.ones(3))
        return model(x).sum()

    with pytest.raises(ValueError, match=re.escape("changed the structure of its nnx arguments") + ".*__init__"):
        automap.partition(step, mesh=MESH).plan(MLP(nnx.Rngs(0)), mlp_batch()["x"])
