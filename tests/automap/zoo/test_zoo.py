"""Model zoo: every variant trains under jit, linen/nnx layouts match, expert specs are valid."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from automap import zoo

TINY = dict(vocab=32, seq=8, d_model=16, heads=2, layers=2, mlp_ratio=2, batch=4)
FRONTS = {"linen": zoo.gpt_linen, "nnx": zoo.gpt_nnx}
MLP_CFG = zoo.MLPConfig(d_in=8, hidden=(16, 16), d_out=4, batch=4)
# XLA:CPU compiles these tiny programs ~5x faster without optimisation passes and fusion emitters.
FAST = {
    "xla_backend_optimization_level": 0,
    "xla_llvm_disable_expensive_passes": True,
    "xla_cpu_use_fusion_emitters": False,
}
jit = functools.partial(jax.jit, compiler_options=FAST)

# (front end, GPTConfig overrides): one row per variant.
GPT_VARIANTS = (
    [
        (front, dict(scan=scan, remat=remat))
        for front in FRONTS
        for scan in (False, True)
        for remat in (False, True)
    ]
    + [(front, dict(gated_mlp=True, separate_qkv=True)) for front in FRONTS]
    + [(front, dict(dropout=0.1, scan=True, remat=True)) for front in FRONTS]
)


def _gpt(front, **overrides):
    return FRONTS[front](zoo.GPTConfig(**{**TINY, **overrides}))


def _workloads():
    gpts = [
        pytest.param(functools.partial(_gpt, f, **kw), id=f"{f}-{kw}") for f, kw in GPT_VARIANTS
    ]
    return gpts + [pytest.param(lambda: zoo.mlp(MLP_CFG), id="mlp")]


def _shapes(tree):
    return jax.tree.map(lambda x: (tuple(x.shape), jnp.dtype(x.dtype)), tree)


def _paths(tree):
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {jax.tree_util.keystr(p): tuple(x.shape) for p, x in flat}


def _count(jaxpr, name):
    """Occurrences of primitive `name`, recursing into sub-jaxprs held in eqn params."""
    total = 0
    for eqn in jaxpr.eqns:
        total += eqn.primitive.name == name
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    total += _count(sub.jaxpr, name)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    total += _count(sub, name)
    return total


@pytest.mark.parametrize("make", _workloads())
def test_variant_trains_under_jit(make):
    w = make()
    state, batch = w.init(0)
    assert _shapes(w.abstract()) == _shapes((state, batch))
    step = jit(w.train_step)
    losses = []
    for _ in range(3):
        state, loss = step(state, batch)
        losses.append(float(loss))
    assert np.all(np.isfinite(losses)), losses
    assert losses[-1] < losses[0], (w.name, losses)
    assert _shapes(state) == _shapes(w.abstract()[0])


def test_init_is_deterministic_per_seed():
    w = _gpt("nnx", scan=True)
    a, b, c = w.init(0)[0], w.init(0)[0], w.init(1)[0]
    np.testing.assert_array_equal(a["params"]["wte"]["embedding"], b["params"]["wte"]["embedding"])
    assert not np.array_equal(a["params"]["wte"]["embedding"], c["params"]["wte"]["embedding"])
    assert float(jnp.std(a["params"]["head"]["kernel"])) == pytest.approx(0.02, rel=0.2)
    np.testing.assert_array_equal(a["params"]["ln_f"]["scale"], np.ones(16))
    # linen draws the very same values; the optimizer state is exactly optimizer.init(params).
    linen = _gpt("linen", scan=True).init(0)[0]
    jax.tree.map(np.testing.assert_array_equal, linen, a)
    fresh = jit(zoo.make_optimizer(1e-3).init)(a["params"])
    jax.tree.map(np.testing.assert_array_equal, a["opt_state"], fresh)
    assert jax.tree.structure(a["opt_state"]) == jax.tree.structure(fresh)


def test_names_and_batch_layout():
    assert _gpt("linen", scan=True).name == "gpt_linen_l2_scan"
    w = _gpt("nnx", dropout=0.1)
    assert w.name == "gpt_nnx_l2_dropout"
    batch = w.abstract()[1]
    assert _shapes(batch) == {
        "tokens": ((4, 8), jnp.dtype(jnp.int32)),
        "targets": ((4, 8), jnp.dtype(jnp.int32)),
        "rng": ((2,), jnp.dtype(jnp.uint32)),
    }
    assert set(zoo.mlp(MLP_CFG).abstract()[1]) == {"x", "y"}


@pytest.mark.parametrize(
    "overrides",
    [{}, dict(scan=True), dict(gated_mlp=True, separate_qkv=True, scan=True, remat=True),
     dict(heads=4, kv_heads=2, scan=True)],
)
def test_linen_and_nnx_share_layout_and_math(overrides):
    linen, nnx = _gpt("linen", **overrides), _gpt("nnx", **overrides)
    (ls, _), (ns, _) = linen.abstract(), nnx.abstract()
    assert _paths(ls) == _paths(ns)
    assert jax.tree.structure(ls) == jax.tree.structure(ns)
    # Same math: nnx's loss on linen's parameters equals linen's loss.
    state, batch = linen.init(0)
    np.testing.assert_allclose(
        jit(nnx.loss_fn)(state["params"], batch),
        jit(linen.loss_fn)(state["params"], batch),
        rtol=1e-5,
    )


def test_documented_leaf_paths():
    paths = _paths(_gpt("linen", scan=True, gated_mlp=True).abstract()[0]["params"])
    assert paths["['blocks']['attn']['qkv']['kernel']"] == (2, 16, 3, 2, 8)
    assert paths["['blocks']['attn']['out']['kernel']"] == (2, 2, 8, 16)
    assert paths["['blocks']['mlp']['gate']['kernel']"] == (2, 16, 32)
    assert paths["['wte']['embedding']"] == (32, 16)
    assert paths["['wpe']['embedding']"] == (8, 16)
    assert paths["['head']['kernel']"] == (16, 32)
    assert paths["['ln_f']['scale']"] == (16,)
    paths = _paths(_gpt("nnx", separate_qkv=True).abstract()[0]["params"])
    assert paths["['blocks_1']['attn']['q']['kernel']"] == (16, 2, 8)
    assert paths["['blocks_1']['attn']['v']['bias']"] == (2, 8)
    assert "['blocks_1']['attn']['qkv']['kernel']" not in paths
    gqa = _gpt("linen", heads=4, kv_heads=2)
    paths = _paths(gqa.abstract()[0]["params"])
    assert (paths["['blocks_0']['attn']['q']['kernel']"], paths["['blocks_0']['attn']['k']['kernel']"],
            paths["['blocks_0']['attn']['v']['bias']"], paths["['blocks_0']['attn']['out']['kernel']"]) == (
        (16, 4, 4), (16, 2, 4), (2, 4), (4, 4, 16))
    assert gqa.name == "gpt_linen_l2_kv2"
    assert _paths(_gpt("nnx", ffn=24, gated_mlp=True).abstract()[0]["params"])["['blocks_0']['mlp']['gate']['kernel']"] == (16, 24)
    assert _gpt("linen", kv_heads=2).name == "gpt_linen_l2"  # kv_heads == heads: plain MHA, fused qkv


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_grouped_attention_is_attention_with_repeated_kv_heads(kv_heads):
    q, k, v = (jax.random.normal(jax.random.key(i), (2, 5, h, 3)) for i, h in enumerate((4, kv_heads, kv_heads)))
    repeat = functools.partial(jnp.repeat, repeats=4 // kv_heads, axis=2)  # kv head j serves queries of group j
    np.testing.assert_allclose(zoo.train.causal_attention(q, k, v),
                               zoo.train.causal_attention(q, repeat(k), repeat(v)), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("overrides, match", [
    (dict(heads=4, kv_heads=3), "heads=4 is not a multiple of kv_heads=3"),
    (dict(heads=4, kv_heads=0), "heads=4 is not a multiple of kv_heads=0"),
])
def test_gpt_config_errors(overrides, match):
    with pytest.raises(ValueError, match=match):
        zoo.GPTConfig(**overrides)


@pytest.mark.parametrize("front", FRONTS)
@pytest.mark.parametrize("remat", [False, True])
def test_scanned_jaxpr_has_one_forward_scan(front, remat):
    w = _gpt(front, scan=True, remat=remat, layers=3)
    state, batch = w.abstract()
    assert _count(jax.make_jaxpr(w.loss_fn)(state["params"], batch).jaxpr, "scan") == 1
    assert _count(jax.make_jaxpr(w.train_step)(state, batch).jaxpr, "scan") == 2
    unrolled = _gpt(front, layers=3)
    assert _count(jax.make_jaxpr(unrolled.train_step)(*unrolled.abstract()).jaxpr, "scan") == 0


MESH = jax.sharding.AbstractMesh((2, 4), ("data", "model"))
EXPERTS = [
    zoo.experts.data_parallel,
    zoo.experts.megatron,
    zoo.experts.fsdp,
    zoo.experts.fsdp_megatron,
]


@pytest.mark.parametrize("expert", EXPERTS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("make", _workloads())
def test_expert_specs_are_well_formed(expert, make):
    state, batch = make().abstract()
    state_specs, batch_specs = expert(state, batch, MESH)
    assert jax.tree.structure(state_specs) == jax.tree.structure(state)
    assert jax.tree.structure(batch_specs) == jax.tree.structure(batch)
    sizes = dict(MESH.shape)
    leaves, specs = jax.tree.leaves((state, batch)), jax.tree.leaves((state_specs, batch_specs))
    for leaf, spec in zip(leaves, specs, strict=True):
        assert isinstance(spec, P)
        assert len(spec) in (0, leaf.ndim)
        for dim, axis in zip(leaf.shape, spec, strict=False):
            assert axis is None or dim % sizes[axis] == 0


def test_megatron_table():
    w = _gpt("linen", scan=True, gated_mlp=True, heads=4)
    state, batch = w.abstract()
    specs, batch_specs = zoo.experts.megatron(state, batch, MESH)
    blk = specs["params"]["blocks"]
    assert blk["attn"]["qkv"]["kernel"] == P(None, None, None, "model", None)
    assert blk["attn"]["qkv"]["bias"] == P(None, None, "model", None)
    assert blk["attn"]["out"]["kernel"] == P(None, "model", None, None)
    assert blk["attn"]["out"]["bias"] == P()
    assert blk["mlp"]["gate"]["kernel"] == P(None, None, "model")
    assert blk["mlp"]["up"]["bias"] == P(None, "model")
    assert blk["mlp"]["down"]["kernel"] == P(None, "model", None)
    assert blk["ln1"]["scale"] == P()
    assert specs["params"]["wte"]["embedding"] == P("model", None)
    assert specs["params"]["wpe"]["embedding"] == P()
    assert specs["params"]["head"]["kernel"] == P(None, "model")
    assert specs["params"]["head"]["bias"] == P("model")
    adam = specs["opt_state"][1][0]
    assert adam.count == P()
    assert adam.mu["blocks"]["attn"]["qkv"]["kernel"] == blk["attn"]["qkv"]["kernel"]
    assert adam.nu["head"]["kernel"] == P(None, "model")
    assert batch_specs == {"tokens": P("data", None), "targets": P("data", None)}
    assert zoo.experts.megatron(state, batch, MESH, data=None)[1]["tokens"] == P()

    unrolled = zoo.experts.megatron(*_gpt("nnx", separate_qkv=True, heads=4).abstract(), MESH)[0]
    assert unrolled["params"]["blocks_0"]["attn"]["k"]["kernel"] == P(None, "model", None)
    assert unrolled["params"]["blocks_0"]["attn"]["k"]["bias"] == P("model", None)
    assert unrolled["params"]["blocks_0"]["mlp"]["up"]["kernel"] == P(None, "model")

    mlp_specs = zoo.experts.megatron(*zoo.mlp(MLP_CFG).abstract(), MESH)[0]["params"]
    assert mlp_specs["layers_0"]["kernel"] == P(None, "model")
    assert mlp_specs["layers_0"]["bias"] == P("model")
    assert mlp_specs["layers_1"]["kernel"] == P("model", None)
    assert mlp_specs["layers_1"]["bias"] == P()


def test_data_parallel_and_fsdp_tables():
    state, batch = _gpt("linen", scan=True).abstract()
    dp_state, dp_batch = zoo.experts.data_parallel(state, batch, MESH)
    assert all(s == P() for s in jax.tree.leaves(dp_state))
    assert dp_batch["tokens"] == P("data", None)

    specs = zoo.experts.fsdp(state, batch, MESH)[0]["params"]
    assert specs["blocks"]["mlp"]["up"]["kernel"] == P(None, None, "data")  # (L, 16, 32): largest
    assert specs["blocks"]["ln1"]["scale"] == P(None, "data")  # never the layers dim
    assert specs["wte"]["embedding"] == P("data", None)  # (32, 16)

    both = zoo.experts.fsdp_megatron(state, batch, MESH)[0]["params"]
    assert both["blocks"]["mlp"]["up"]["kernel"] == P(None, "data", "model")
    assert both["wte"]["embedding"] == P("model", "data")
    assert both["head"]["bias"] == P("model")  # (32,): no dim left for data


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices, see conftest.py")
@pytest.mark.parametrize("expert", EXPERTS, ids=lambda f: f.__name__)
def test_expert_specs_compile_and_match_numerics(expert):
    w = _gpt("linen", scan=True, heads=4)
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    state, batch = w.init(0)
    state_specs, batch_specs = expert(state, batch, mesh)

    def shard(specs):
        return jax.tree.map(lambda s: NamedSharding(mesh, s), specs)

    step = jit(w.train_step, in_shardings=(shard(state_specs), shard(batch_specs)))
    _, loss = step(state, batch)
    np.testing.assert_allclose(loss, jit(w.loss_fn)(state["params"], batch), rtol=1e-5)


def test_a_workloads_own_optimizer_starts_from_its_init_of_the_filled_params():
    """``make_workload(optimizer=...)``: the train step uses it, and its state is ``optimizer.init``
    of the filled parameters, not zeros (Prodigy's step size starts at its ``d_coef``-scaled
    estimate, its ``params0`` are the parameters); the zoo's default keeps Adam's zeros."""
    import optax

    from automap.zoo.train import make_workload

    def build(optimizer=None):
        return make_workload(
            "toy", None, loss_fn=lambda p, b: jnp.sum((p["w"] * b["x"]) ** 2),
            abstract_params=lambda: {"w": jax.ShapeDtypeStruct((3,), jnp.float32)},
            fill_param=lambda names, leaf, rng: rng.normal(size=leaf.shape),
            abstract_batch=lambda: {"x": jax.ShapeDtypeStruct((3,), jnp.float32)},
            make_batch=lambda seed: {"x": np.ones(3, np.float32)}, learning_rate=0.1, optimizer=optimizer)

    prodigy = optax.contrib.prodigy(1.0)
    state, batch = build(prodigy).init(0)
    want = prodigy.init(state["params"])
    assert jax.tree.structure(state["opt_state"]) == jax.tree.structure(want)
    for got, ref in zip(jax.tree.leaves(state["opt_state"]), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(got, ref)
    assert np.array_equal(state["opt_state"].params0["w"], state["params"]["w"])  # not zeros
    new, _ = jax.jit(build(prodigy).train_step)(state, batch)
    ref_updates, _ = prodigy.update(jax.grad(lambda p: jnp.sum((p["w"] * batch["x"]) ** 2))(state["params"]),
                                    want, state["params"])
    np.testing.assert_allclose(new["params"]["w"], state["params"]["w"] + ref_updates["w"], rtol=1e-5)
    default_state, _ = build().init(0)
    assert all(not np.any(np.asarray(leaf)) for leaf in jax.tree.leaves(default_state["opt_state"]))
