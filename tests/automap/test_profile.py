"""The symbolic profiler: exact FLOPs and memory categories of zoo models from shapes alone."""
import time

import jax
import jax.numpy as jnp
import pytest

import automap
from automap import zoo
from automap.profile import Profile, profile

TINY = dict(layers=2, d_model=32, heads=4, vocab=64, seq=16, batch=8)


def _nbytes(tree) -> int:
    return sum(leaf.size * jnp.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree))


def _gpt_dot_flops(c: zoo.GPTConfig) -> int:
    """Forward + backward matmul FLOPs of the zoo GPT.

    Every dense kernel with P weights costs 2*P per token forward and 4*P backward (input and
    weight gradients; block 0 needs its input gradient too, for the embeddings): 6 * P * tokens.
    Per layer P = qkv 3D^2 + out D^2 + up D*F + down F*D, plus the head D*V (embeddings are
    gathers, no matmul). Attention scores q.k and the value product p.v each cost 2*B*S^2*D
    forward and twice that backward: 12 * B * S^2 * D per layer.
    """
    d, f, tokens = c.d_model, c.hidden, c.batch * c.seq
    dense = c.layers * (4 * d * d + 2 * d * f) + d * c.vocab
    attention = 12 * c.batch * c.seq**2 * d * c.layers
    return 6 * dense * tokens + attention


@pytest.fixture(scope="module")
def tiny():
    w = zoo.gpt_linen(zoo.GPTConfig(**TINY))
    return w, profile(w.train_step, *w.abstract())


@pytest.fixture(scope="module")
def tiny_scan():
    w = zoo.gpt_linen(zoo.GPTConfig(**TINY, scan=True))
    return w, profile(w.train_step, *w.abstract())


def test_reexported():
    assert automap.profile is profile and automap.Profile is Profile


def test_dot_flops_closed_form(tiny, tiny_scan):
    w, p = tiny
    assert p.totals.dot_flops == _gpt_dot_flops(w.config) == 22_020_096
    assert tiny_scan[1].totals.dot_flops == _gpt_dot_flops(w.config)


def test_scan_totals_equal_unrolled(tiny, tiny_scan):
    (_, unrolled), (_, scanned) = tiny, tiny_scan
    assert scanned.totals.dot_flops == unrolled.totals.dot_flops
    backward = lambda p: sum(r.flops for r in p.ops if r.phase == "backward")  # noqa: E731
    assert backward(scanned) == backward(unrolled)
    # the programs differ slightly elsewhere: jax hoists the causal mask and 1/sqrt(head_dim) out of
    # the forward scan (computed once, not per layer), and the optimizer's global norm adds up 18
    # stacked leaves instead of 30
    assert abs(scanned.totals.flops - unrolled.totals.flops) < 1e-4 * unrolled.totals.flops
    assert max(r.count for r in scanned.ops) == TINY["layers"]  # scan bodies run once per layer
    assert max(r.count for r in unrolled.ops) == 1


@pytest.mark.parametrize("name", ["tiny", "tiny_scan"])
def test_rows_sum_to_totals(name, request):
    _, p = request.getfixturevalue(name)
    for rows in (p.ops, p.modules, p.by_module(1), p.by_module(5)):
        assert sum(r.flops for r in rows) == p.totals.flops
        assert sum(r.dot_flops for r in rows) == p.totals.dot_flops
        assert sum(r.bytes for r in rows) == p.totals.bytes_accessed
    assert {m.module for m in p.modules} >= {"GPT/head", "GPT/ln_f"}
    assert all(m.module.count("/") <= 1 for m in p.modules)


@pytest.mark.parametrize("name", ["tiny", "tiny_scan"])
def test_memory_categories(name, request):
    w, p = request.getfixturevalue(name)
    state, batch = w.abstract()
    params = _nbytes(state["params"])
    mem = p.memory
    assert list(mem) == ["params", "optimizer_state", "data", "activations", "gradients", "peak"]
    assert mem["params"] == params
    assert mem["optimizer_state"] == _nbytes(state["opt_state"]) == 2 * params + 4  # adam mu, nu + count
    assert mem["data"] == _nbytes(batch)
    assert mem["gradients"] == params  # one gradient per parameter, read by the optimizer
    assert 0 < mem["activations"] < mem["peak"]
    assert mem["peak"] >= mem["params"] + mem["optimizer_state"] + mem["data"]
    assert all(r.category == "params" for r in p.inputs if r.path.startswith("state/params/"))
    assert all(r.category == "data" for r in p.inputs if r.path.startswith("batch/"))


def test_scan_residuals_count_in_full(tiny, tiny_scan):
    # the scanned model saves stacked residuals of every elementwise step: at least as many bytes
    assert tiny_scan[1].memory["activations"] >= tiny[1].memory["activations"]


def f32(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def _sgd(params, x):
    x = x["mu"] if isinstance(x, dict) else x
    loss, g = jax.value_and_grad(lambda p: jnp.sum(jnp.tanh(x @ p["w"]) * p["s"]))(params)
    return jax.tree.map(lambda a, b: a - 0.1 * b, params, g), loss


def _momentum(state, x):
    w, m, step = state
    g = jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)
    m = 0.9 * m + g
    return (w - 0.1 * m, m, step + 1), None


# one row per case: function, args, expected category per input leaf (in flattening order)
CATEGORY_CASES = [
    # structure: returned updated + read forward -> params; the rest is data, whatever its name
    ("sgd", _sgd, ({"s": f32(2), "w": f32(4, 2)}, f32(8, 4)), ["params", "params", "data"]),
    ("unreturned named like optax", _sgd, ({"s": f32(2), "w": f32(4, 2)}, {"mu": f32(8, 4)}),
     ["params", "params", "optimizer_state"]),
    # structure: returned updated but read only by the optimizer -> optimizer state, unnamed
    ("momentum tuple", _momentum, ((f32(4, 2), f32(4, 2), jax.ShapeDtypeStruct((), jnp.int32)), f32(8, 4)),
     ["params", "optimizer_state", "optimizer_state", "data"]),
    # no backward pass: names break the tie; a loss_fn's params are not returned but named
    ("loss only", lambda params, batch: jnp.sum(batch @ params["w"]), ({"w": f32(4, 2)}, f32(8, 4)),
     ["params", "data"]),
    ("leftmost name decides", lambda s, x: jnp.sum(x @ s["params"]["w"]) + jnp.sum(s["opt_state"]["mu"]["params"]["w"]),
     ({"params": {"w": f32(4, 2)}, "opt_state": {"mu": {"params": {"w": f32(4, 2)}}}}, f32(8, 4)),
     ["optimizer_state", "params", "data"]),
    ("no grad state", lambda s, x: ({"w": s["w"] + 1, "opt_state": {"nu": s["opt_state"]["nu"] * 2}}, x.sum()),
     ({"w": f32(2), "opt_state": {"nu": f32(2)}}, f32(3)), ["optimizer_state", "params", "data"]),
]


@pytest.mark.parametrize("case,fn,args,expected", CATEGORY_CASES, ids=[c[0] for c in CATEGORY_CASES])
def test_categorisation(case, fn, args, expected):
    p = profile(fn, *args)
    assert [r.category for r in p.inputs] == expected, p.inputs


def test_static_and_donated_args():
    def step(w, x, scale):
        return w - scale * jnp.sum(x @ w), None

    p = profile(step, f32(4, 2), f32(8, 4), 0.5, static_argnums=(2,))
    donated = profile(step, f32(4, 2), f32(8, 4), 0.5, static_argnums=(2,), donate_argnums=(0,))
    assert [r.path for r in p.inputs] == ["w", "x"]
    assert p.peak.aliased == 0 and donated.peak.aliased == 32
    assert donated.memory["peak"] == p.memory["peak"] - 32  # the new w reuses the old w's buffer
    # x @ w (64 bytes) and its sum (4) are temporaries: neither has the size of w's buffer (32)
    assert p.peak.temp == donated.peak.temp == 68


def test_table_and_estimate(tiny):
    _, p = tiny
    text = p.table(top=5)
    assert "GPT/blocks_0" in text and "optimizer_state" in text and "KiB" in text
    assert len([line for line in text.splitlines() if line.startswith("dot_general")]) == 5
    e = p.estimate()
    assert e.dot_flops == p.totals.dot_flops and e.memory.peak == p.memory["peak"]
    assert e.flops == p.totals.flops and e.bytes_accessed == p.totals.bytes_accessed
    assert e.time_s > 0


def test_gc_state_restored():
    import gc

    gc.disable()
    try:
        profile(lambda x: x * 2, f32(3))
        assert not gc.isenabled()
    finally:
        gc.enable()
    profile(lambda x: x * 2, f32(3))
    assert gc.isenabled()


def test_huge_model_allocates_nothing():
    cfg = zoo.GPTConfig(layers=4, d_model=4096, heads=32, vocab=50_304, seq=2048, batch=16, scan=True)
    w = zoo.gpt_linen(cfg)
    args = w.abstract()
    before = len(jax.live_arrays())
    start = time.perf_counter()
    p = profile(w.train_step, *args)
    assert time.perf_counter() - start < 20
    assert len(jax.live_arrays()) == before
    assert p.memory["params"] == _nbytes(args[0]["params"]) > 3 * 2**30  # ~1 B params, fp32
    assert p.totals.dot_flops == _gpt_dot_flops(cfg)
    assert "GiB" in p.table(top=3)
