"""``tactics.megatron``: on every zoo GPT variant, ``schedule(data_parallel, megatron)`` finds the
expert Megatron plan (``zoo.experts.megatron``) for every parameter and optimizer-state leaf and
compiles to the expert's collective bytes; on MLPs, a two-branch model and two convolutions it pairs
column with row weights and says which; where it cannot apply it leaves the state alone and says why."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import tree_util
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import automap
import tactics
from automap import zoo

CFG = dict(layers=2, vocab=64, seq=16, d_model=32, heads=4, batch=8)
MESH = automap.make_mesh({"data": 2, "model": 4})
TP = tactics.schedule(tactics.data_parallel("data"), tactics.megatron("model"))
FRONTS = {"linen": zoo.gpt_linen, "nnx": zoo.gpt_nnx}
# XLA:CPU compiles these tiny programs several times faster without optimisation passes; the SPMD
# partitioner (and so every collective) runs all the same
FAST = {
    "xla_backend_optimization_level": 0,
    "xla_llvm_disable_expensive_passes": True,
    "xla_cpu_use_fusion_emitters": False,
}

# (front end, GPTConfig overrides, compile and measure?): one row per zoo variant
GPT_VARIANTS = [
    ("linen", dict(scan=False), True),
    ("linen", dict(scan=True), False),
    ("linen", dict(scan=True, remat=True), False),
    ("linen", dict(scan=False, remat=True), False),
    ("nnx", dict(scan=False), False),
    ("nnx", dict(scan=True), True),
    ("nnx", dict(scan=True, remat=True), False),
    ("nnx", dict(scan=False, remat=True), False),
    ("linen", dict(gated_mlp=True, separate_qkv=True), True),
    ("nnx", dict(gated_mlp=True, separate_qkv=True, scan=True), False),
    ("linen", dict(dropout=0.1, scan=True, remat=True), False),
    ("linen", dict(heads=8, kv_heads=4), True),  # GQA: 2 query heads per k/v head, heads over model=4
    ("nnx", dict(heads=8, kv_heads=4, scan=True), False),
    ("linen", dict(kv_heads=1), False),  # MQA: query heads over model, the one k/v head replicated
]


def _is_spec(x):
    return isinstance(x, P)


def _norm(spec, ndim):
    entries = tuple(spec) + (None,) * (ndim - len(tuple(spec)))
    return tuple(e[0] if isinstance(e, tuple) and len(e) == 1 else e for e in entries)


def assert_valid(plan):
    """Every value's spec is one a mesh can hold: known axes, each once, dividing its dim."""
    sizes = dict(plan.mesh.shape)
    for vid, spec in plan.state.specs.items():
        value = plan.program.values[vid]
        axes = [a for dim in spec for a in dim]
        assert len(axes) == len(set(axes)) and set(axes) <= set(sizes), (value.name, spec)
        assert len(spec) == value.ndim, (value.name, spec)
        for size, dim in zip(value.shape, spec, strict=True):
            assert size % math.prod(sizes[a] for a in dim) == 0, (value.name, value.shape, spec)


def _mismatches(plan, want_tree):
    """(path, got, want) for every input leaf whose spec is not the expert's."""
    want = tree_util.tree_leaves(want_tree, is_leaf=_is_spec)
    program = plan.program
    out = []
    for path, vid, w in zip(program.input_paths, program.inputs, want, strict=True):
        ndim = program.values[vid].ndim
        got = _norm(plan.state.partition_spec(vid), ndim)
        if got != _norm(w, ndim):
            out.append((path, got, _norm(w, ndim)))
    return out


@pytest.mark.parametrize("front, overrides, compile_", GPT_VARIANTS,
                         ids=[f"{f}-{'-'.join(k for k, v in o.items() if v) or 'plain'}" for f, o, _ in GPT_VARIANTS])
def test_megatron_finds_the_expert_plan_on_gpt(front, overrides, compile_):
    cfg = zoo.GPTConfig(**{**CFG, **overrides})
    w = FRONTS[front](cfg)
    state, batch = w.init(0) if compile_ else w.abstract()
    step = automap.automap(w.train_step, mesh=MESH, tactics=[TP])
    plan = step.plan(state, batch)
    expert = zoo.experts.megatron(state, batch, MESH)

    # every parameter, optimizer-state and batch leaf: exactly the expert spec
    bad = _mismatches(plan, expert)
    assert not bad, "\n".join(f"{p}: got {g}, expert {e}" for p, g, e in bad)
    assert sum(1 for s in tree_util.tree_leaves(expert[0], is_leaf=_is_spec) if "model" in tuple(s)) >= 6
    assert_valid(plan)
    # the report says which ops were paired: one column/row pair per attention and per MLP per layer
    pairs = [n for n in plan.notes if " paired with row " in n]
    assert len(pairs) == (2 if overrides.get("scan") else 2 * CFG["layers"])
    assert sum("vocab-parallel embedding" in n for n in plan.notes) == 1
    assert sum("vocab-parallel head" in n for n in plan.notes) == 1
    if front == "linen":
        layer = "blocks" if overrides.get("scan") else "blocks_0"
        q = "qkv" if cfg.fused_qkv else "q"
        up = "gate" if overrides.get("gated_mlp") else "up"
        assert f"megatron('model'): column GPT/{layer}/attn/{q} paired with row GPT/{layer}/attn/out" in plan.notes
        assert f"megatron('model'): column GPT/{layer}/mlp/{up} paired with row GPT/{layer}/mlp/down" in plan.notes

    if not compile_:
        return
    # the compiled program moves the bytes the expert specs do, given straight to jax.jit
    compiled = step.lower(state, batch).compile(FAST)
    ours = automap.measure(compiled)
    shardings = jax.tree.map(lambda s: NamedSharding(MESH, s), expert, is_leaf=_is_spec)
    theirs = automap.measure(jax.jit(w.train_step, in_shardings=shardings).lower(state, batch).compile(FAST))
    assert theirs.collective_bytes > 0
    assert abs(ours.collective_bytes - theirs.collective_bytes) <= 0.01 * theirs.collective_bytes, (
        ours.collectives, theirs.collectives)
    # and computes the unsharded step
    outs = compiled(*jax.tree.leaves(jax.device_put((state, batch), plan.in_shardings)))
    _, loss = tree_util.tree_unflatten(plan.traced.out_tree, outs)
    np.testing.assert_allclose(loss, jax.jit(w.train_step).lower(state, batch).compile(FAST)(state, batch)[1], rtol=1e-5)


# ---------------------------------------------------------------------------- MLPs and branches

def _param_specs(plan):
    prefix = "state/params/"
    return {p[len(prefix):]: plan.state.partition_spec(v)
            for p, v in zip(plan.program.input_paths, plan.program.inputs, strict=True) if p.startswith(prefix)}


def _pairs(plan):
    return [n.split(": ", 1)[1] for n in plan.notes if n.startswith("megatron('model'): ")]


@pytest.mark.parametrize("hidden, want_pairs", [
    ((64, 64), ["column MLP/layers_0 paired with row MLP/layers_1", "vocab-parallel head MLP/layers_2"]),
    ((64, 64, 64), ["column MLP/layers_0 paired with row MLP/layers_1",
                    "column MLP/layers_2 paired with row MLP/layers_3"]),
    ((64, 64, 64, 64), ["column MLP/layers_0 paired with row MLP/layers_1",
                        "column MLP/layers_2 paired with row MLP/layers_3",
                        "vocab-parallel head MLP/layers_4"]),
], ids=["3-layers", "4-layers", "5-layers"])
def test_megatron_pairs_mlp_layers_column_then_row(hidden, want_pairs):
    w = zoo.mlp(zoo.MLPConfig(d_in=32, hidden=hidden, d_out=16, batch=8))
    state, batch = w.abstract()
    plan = automap.automap(w.train_step, mesh=MESH, tactics=[TP]).plan(state, batch)
    assert _pairs(plan) == want_pairs
    assert all(p in plan.report() for p in want_pairs)
    # the parameters and Adam moments are the expert's alternating column/row specs
    bad = [b for b in _mismatches(plan, zoo.experts.megatron(state, batch, MESH)) if b[0].startswith("state/")]
    assert not bad, bad
    assert_valid(plan)


def test_megatron_pairs_each_branch():
    w = zoo.branches(zoo.BranchesConfig(d_in=32, hidden=64, d_out=16, batch=8))
    state, batch = w.init(0)
    step = automap.automap(w.train_step, mesh=MESH, tactics=[TP])
    plan = step.plan(state, batch)
    assert _pairs(plan) == [
        "column Branches/w_a paired with row Branches/w_out",
        "column Branches/v_a paired with row Branches/v_out",
    ]
    col, row = {"kernel": P(None, "model"), "bias": P("model")}, {"kernel": P("model"), "bias": P()}
    # w_b feeds the product with w_a's column: it follows, column-parallel too
    want = {f"{layer}/{leaf}": spec[leaf] for layer, spec in
            [("w_a", col), ("w_b", col), ("v_a", col), ("w_out", row), ("v_out", row)] for leaf in spec}
    assert _param_specs(plan) == want
    assert_valid(plan)
    # the plan computes the unsharded step
    _, loss = step(state, batch)
    np.testing.assert_allclose(loss, jax.jit(w.train_step)(state, batch)[1], rtol=1e-5)


def _lora_mlp(bypass_first):
    """An MLP whose up projection has a rank-8 LoRA bypass (``x @ a @ b`` added to ``x @ up``, as
    ``nnx.LoRA`` computes it), the bypass first or second in program order."""
    def loss(params, x):
        if bypass_first:
            h = (x @ params["a"]) @ params["b"] + x @ params["up"]
        else:
            h = x @ params["up"] + (x @ params["a"]) @ params["b"]
        h = jax.nn.relu(h)
        return jnp.mean((h @ params["down"]) ** 2)
    return loss


@pytest.mark.parametrize("bypass_first", [True, False], ids=["bypass-first", "bypass-second"])
def test_megatron_leaves_a_low_rank_bypass_inside_the_pair(bypass_first):
    """The bypass's ``a`` is no column of a pair with ``b``: its partial sum would be all-reduced
    inside ``up``'s column region (XLA: 2 all-gathers and a reduce-scatter more, 2.6x the bytes).
    ``b`` takes the region's tiling on its output feature, ``a`` stays whole."""
    rng = np.random.RandomState(0)
    shapes = dict(up=(32, 64), a=(32, 8), b=(8, 64), down=(64, 32))
    params = {k: jnp.asarray(rng.randn(*s).astype(np.float32) * 0.1) for k, s in shapes.items()}
    x = jnp.asarray(rng.randn(8, 16, 32).astype(np.float32))
    step = automap.automap(_sgd(_lora_mlp(bypass_first)), mesh=MESH, tactics=[TP], search=None)
    plan = step.plan(params, x)
    assert len(_pairs(plan)) == 1, _pairs(plan)
    assert {k: tuple(s.spec) for k, s in plan.in_shardings[0].items()} == {
        "a": (), "b": (None, "model"), "up": (None, "model"), "down": ("model",)}
    compiled = step.lower(params, x).compile(FAST)
    assert {k for k, c in automap.measure(compiled).collectives.items() if c.count} == {"all-reduce"}
    out, ref = step(params, x), jax.jit(_sgd(_lora_mlp(bypass_first)))(params, x)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), out, ref)


def _two_convs(layout):
    """Two 3x3 convolutions with biases and a ReLU between, in ``layout``'s dimension numbers
    (flax's NHWC/HWIO or equinox's NCHW/OIHW): the first's output features are the second's input."""
    dn = {"nhwc": ("NHWC", "HWIO", "NHWC"), "nchw": ("NCHW", "OIHW", "NCHW")}[layout]
    feature = dn[0].index("C")
    bias = lambda b: b.reshape([-1 if i == feature else 1 for i in range(4)])  # noqa: E731

    def loss(params, x):
        def conv(x, w):
            return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=dn)
        h = jax.nn.relu(conv(x, params["c1"]) + bias(params["b1"]))
        return jnp.mean((conv(h, params["c2"]) + bias(params["b2"])) ** 2)
    return loss


# (layout, kernel shapes, image shape, the kernels' expected specs: conv1 column, conv2 row)
CONV_PAIRS = [
    ("nhwc", dict(c1=(3, 3, 4, 16), c2=(3, 3, 16, 8)), (8, 8, 8, 4),
     dict(c1=(None, None, None, "model"), c2=(None, None, "model"))),
    ("nchw", dict(c1=(16, 4, 3, 3), c2=(8, 16, 3, 3)), (8, 4, 8, 8),
     dict(c1=("model",), c2=(None, "model"))),
]


@pytest.mark.parametrize("layout, kernels, image, want", CONV_PAIRS, ids=[r[0] for r in CONV_PAIRS])
def test_megatron_pairs_convolutions_column_then_row(layout, kernels, image, want):
    """A conv's output features are a column split and the next conv's input features the row
    (found from the conv's factor rule): the first kernel and its bias split on their output
    features, the second kernel on its input features, its result a partial sum all-reduced."""
    rng = np.random.RandomState(0)
    shapes = {**kernels, "b1": (16,), "b2": (8,)}
    params = {k: jnp.asarray(rng.randn(*s).astype(np.float32) * 0.1) for k, s in shapes.items()}
    x = jnp.asarray(rng.randn(*image).astype(np.float32))
    step = automap.automap(_sgd(_two_convs(layout)), mesh=MESH, tactics=[TP], search=None)
    plan = step.plan(params, x)
    assert _pairs(plan) == ["column conv_general_dilated#0 paired with row conv_general_dilated#6"]
    assert {k: tuple(s.spec) for k, s in plan.in_shardings[0].items()} == {**want, "b1": ("model",), "b2": ()}
    assert tuple(plan.in_shardings[1].spec) == ("data",)
    assert_valid(plan)
    compiled = step.lower(params, x).compile(FAST)
    assert {k for k, c in automap.measure(compiled).collectives.items() if c.count} == {"all-reduce"}
    out, ref = step(params, x), jax.jit(_sgd(_two_convs(layout)))(params, x)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), out, ref)


# ---------------------------------------------------------------------------- cannot apply

def _sgd(loss):
    def step(params, batch):
        value, g = jax.value_and_grad(loss)(params, batch)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, g), value
    return step


def _elementwise(params, batch):
    return jnp.mean((params["w"] * batch["x"]) ** 2)


def _single_dot(params, batch):
    return jnp.mean(batch["x"] @ params["w"])


def _sds(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.float32)


@pytest.mark.parametrize("loss, params, batch, axes, why", [
    # no contraction with a weight at all
    (_elementwise, {"w": _sds(8, 16)}, {"x": _sds(8, 16)}, {"model": 8}, "no matmul chain found"),
    # one dot straight into the loss, its only free weight dim (6) not divisible by 8
    (_single_dot, {"w": _sds(16, 6)}, {"x": _sds(8, 16)}, {"model": 8}, "not divisible by 8"),
    # the zoo MLP with hidden sizes the axis does not divide
    (zoo.mlp(zoo.MLPConfig(d_in=32, hidden=(12, 12, 12), d_out=12, batch=8)).loss_fn,
     zoo.mlp(zoo.MLPConfig(d_in=32, hidden=(12, 12, 12), d_out=12, batch=8)).abstract()[0]["params"],
     {"x": _sds(8, 32), "y": _sds(8, 12)}, {"model": 8}, "not divisible by 8"),
], ids=["elementwise", "single-dot", "mlp-hidden-12"])  # no such mesh axis: an error (tests/automap/test_options.py)
def test_megatron_that_cannot_apply_leaves_the_state_and_says_why(loss, params, batch, axes, why):
    mesh = automap.make_mesh(axes)
    plan = automap.partition(_sgd(loss), mesh=mesh, tactics=[tactics.megatron("model")]).plan(params, batch)
    notes = [n for n in plan.notes if n.startswith("megatron('model')")]
    assert any(why in n for n in notes), notes
    assert any("nothing done" in n or "no matmul chain found" in n for n in notes), notes
    assert all(not any(dim) for dim_spec in plan.state.specs.values() for dim in dim_spec), plan.state.specs
    assert all(s.spec == P() for s in jax.tree.leaves(plan.in_shardings))


def test_megatron_skips_only_what_does_not_divide():
    # hidden 24 on model=8 divides; the first layer's 12-wide output does not: that pair is skipped
    w = zoo.mlp(zoo.MLPConfig(d_in=32, hidden=(12, 24, 24), d_out=16, batch=8))
    state, batch = w.abstract()
    mesh = automap.make_mesh({"model": 8})
    plan = automap.automap(w.train_step, mesh=mesh, tactics=[tactics.megatron("model")]).plan(state, batch)
    assert any("skips column MLP/layers_0" in n and "not divisible by 8" in n for n in plan.notes), plan.notes
    assert "megatron('model'): column MLP/layers_2 paired with row MLP/layers_3" in plan.notes
    got = _param_specs(plan)
    assert got["layers_0/kernel"] == P() and got["layers_1/kernel"] == P()
    assert got["layers_2/kernel"] == P(None, "model") and got["layers_3/kernel"] == P("model")
    assert_valid(plan)


def test_megatron_keeps_manual_pins():
    # a manual rule decides first: megatron does not re-tile the weight it pinned
    w = zoo.mlp(zoo.MLPConfig(d_in=32, hidden=(64, 64, 64), d_out=16, batch=8))
    state, batch = w.abstract()
    schedule = [tactics.manual({r"^state/params/layers_0/kernel$": P()}), tactics.megatron("model")]
    plan = automap.automap(w.train_step, mesh=MESH, tactics=schedule).plan(state, batch)
    assert any("skips column MLP/layers_0: pinned by an earlier tactic" in n for n in plan.notes), plan.notes
    got = _param_specs(plan)
    assert got["layers_0/kernel"] == P()
    assert got["layers_2/kernel"] == P(None, "model") and got["layers_3/kernel"] == P("model")
    assert_valid(plan)


def test_megatron_that_cannot_apply_keeps_the_earlier_tactics_plan():
    params, batch = {"w": _sds(16, 6)}, {"x": _sds(8, 16)}
    before = automap.partition(_sgd(_single_dot), mesh=MESH, tactics=[tactics.data_parallel("data")]).plan(params, batch)
    after = automap.partition(_sgd(_single_dot), mesh=MESH, tactics=[TP]).plan(params, batch)
    assert dict(after.state.specs) == dict(before.state.specs)
    assert any("skips head" in n and "not divisible by 4" in n for n in after.notes), after.notes
    assert "megatron('model'): every candidate skipped; nothing done" in after.notes
