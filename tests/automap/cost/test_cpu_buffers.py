"""Buffers XLA:CPU holds beyond the program's values, where its schedule puts them: the memory
estimate against XLA's measure of small training steps on 8 simulated CPU devices."""
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import automap
import tactics


def _max_pool(x):
    return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")


def _estimate_and_measure(fn, args, tactic):
    step = automap.automap(fn, mesh=automap.make_mesh({"data": 8}), tactics=tactic, search=None)
    return step.plan(*args).estimate.peak_memory_bytes, automap.measure(step.lower(*args).compile()).memory_per_device


def test_max_pool_gradients_hold_their_index_arrays_from_the_start_of_the_step():
    """Two max pools, trained: XLA:CPU expands each pool's gradient into a selection (a
    reduce-window over the input and one s32 index array per dim) and a scatter, runs the selection
    in the forward right after the pool's input is made, and makes the index arrays (iotas: they
    read nothing) and the scatter's zeroed buffer at the start of the step, so both pools' arrays
    are there at the first pool. Counted at the gradient, the estimate said 71,744 B against XLA's
    82,168 B (12.7% under); with them where XLA holds them, 79,936 B."""
    def loss(w, v, x):
        h = _max_pool(jnp.tanh(x * w))
        h = _max_pool(jnp.tanh(h * 2.0))
        return (jnp.tanh(h.reshape(h.shape[0], -1) @ v) ** 2).sum()

    def step(w, v, x):
        gw, gv = jax.grad(loss, (0, 1))(w, v, x)
        return w - 0.1 * gw, v - 0.1 * gv

    args = (jax.ShapeDtypeStruct((8,), jnp.float32), jax.ShapeDtypeStruct((128, 2), jnp.float32),
            jax.ShapeDtypeStruct((8, 16, 16, 8), jnp.float32))
    est, xla = _estimate_and_measure(step, args, [tactics.data_parallel("data")])
    assert abs(est / xla - 1) < 0.05, (est, xla)


def test_a_scatter_writes_into_its_zeroed_operand():
    """``zeros.at[idx].add(u)``: XLA's buffer assignment gives the scatter its zeroed operand's
    buffer (no later reader), so the two are one 128 KiB buffer. Counted as two, the estimate said
    462,848 B against XLA's 330,752 B (40% over)."""
    def fn(x, idx, u):
        a = jnp.exp(x)
        b = (a * a.sum(0)).sum(1)
        z = jnp.zeros((512, 64)).at[idx].add(u * b[:, None])
        return jnp.tanh(z).sum(1)

    args = (jax.ShapeDtypeStruct((256, 64), jnp.float32), jax.ShapeDtypeStruct((256,), jnp.int32),
            jax.ShapeDtypeStruct((256, 64), jnp.float32))
    est, xla = _estimate_and_measure(fn, args, [])
    assert abs(est / xla - 1) < 0.01, (est, xla)


def test_a_reduction_reads_its_broadcast_operands_from_buffers():
    """Two RMSNorms with a residual, trained: XLA:CPU fuses a reduction with the elementwise work
    that feeds it alone, but not with a broadcast that spreads a non-scalar operand (each
    norm's rsqrt over the features, read by the scale's gradient): that broadcast is a buffer of
    the full size, made when its source is made and kept until the reduction; and a value other
    ops read too is a buffer of its own. With every operand fused, the estimate said 18,432 B
    against XLA's 132,384 B (86% under); with these buffers, 132,608 B."""
    def loss(s0, s1, x):
        for s in (s0, s1):
            x = x + x * (jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * s)
        return (x * x).mean()

    def step(s0, s1, x):
        g0, g1 = jax.grad(loss, (0, 1))(s0, s1, x)
        return s0 - 0.1 * g0, s1 - 0.1 * g1

    args = (jax.ShapeDtypeStruct((64,), jnp.float32), jax.ShapeDtypeStruct((64,), jnp.float32),
            jax.ShapeDtypeStruct((32, 16, 64), jnp.float32))
    est, xla = _estimate_and_measure(step, args, [tactics.data_parallel("data")])
    assert abs(est / xla - 1) < 0.02, (est, xla)


def test_random_bits_hold_both_threefry_halves_while_read():
    """A dropout mask read again by the gradient: XLA:CPU runs the threefry hash as a loop over
    two uint32 arrays of the bits' size and xors them in each reader, so both stay until the
    last reader. Counted as one buffer, the estimate said 40,968 B against XLA's 49,932 B (18%
    under); with both, 49,160 B."""
    def loss(w, x, key):
        h = jnp.tanh(x * w)
        y = jnp.where(jax.random.bernoulli(key, 0.9, h.shape), h, 0)
        return (jnp.exp(y) * x).sum()

    def step(w, x, key_data):
        return w - 0.1 * jax.grad(loss)(w, x, jax.random.wrap_key_data(key_data))

    args = (jax.ShapeDtypeStruct((256, 64), jnp.float32), jax.ShapeDtypeStruct((256, 64), jnp.float32),
            jax.ShapeDtypeStruct((2,), jnp.uint32))
    est, xla = _estimate_and_measure(step, args, [tactics.data_parallel("data")])
    assert abs(est / xla - 1) < 0.03, (est, xla)


def test_a_constant_is_made_as_split_as_its_reader_needs():
    """The gradient of ``take_along_axis`` scatter-adds into zeros: XLA partitions a broadcast
    constant as its reader needs it, so zeros left replicated in a plan whose scatter-add is
    split cost the split size, not the whole (the held-out odd-sized GPT's default plan: zeros
    f32[6,12,1001] replicated, XLA's buffer f32[6,3,1001]; est/XLA 1.39 -> 1.21). Here the zeros
    replicated by hand: counted whole, the estimate said 480,576 B of temp against 192,192 B as
    planned (the plan's estimate is within 1% of XLA's measure)."""
    import dataclasses

    from automap.cost.memory import estimate_memory

    def loss(w, x, labels):
        return -jnp.take_along_axis(jax.nn.log_softmax(x @ w), labels[..., None], -1).mean()

    def step(w, x, labels):
        return w - 0.1 * jax.grad(loss)(w, x, labels)

    args = (jax.ShapeDtypeStruct((48, 1001), jnp.float32), jax.ShapeDtypeStruct((8, 12, 48), jnp.float32),
            jax.ShapeDtypeStruct((8, 12), jnp.int32))
    est, xla = _estimate_and_measure(step, args, [tactics.data_parallel("data")])
    assert abs(est / xla - 1) < 0.01, (est, xla)
    planned = automap.automap(step, mesh=automap.make_mesh({"data": 8}), tactics=[tactics.data_parallel("data")],
                              search=None).plan(*args).layout
    [scatter] = [op for op in planned.program.ops if op.primitive == "scatter-add"]
    zeros = scatter.inputs[0]
    assert planned.spec(scatter.outputs[0])[0] == ("data",)
    replicated = dataclasses.replace(planned, specs={**planned.specs, zeros: ((), (), ())})
    assert estimate_memory(replicated, platform="cpu") == estimate_memory(planned, platform="cpu")


def test_a_small_reduction_computes_its_operands_inline():
    """Two MLP-Mixer blocks (LayerNorm, transpose, dense over the tokens, transpose back, then
    over the channels), trained: XLA:CPU gives a reduction to its library fusion (which reads
    broadcast and shared operands from buffers of their own) only when it or an operand holds at
    least 4,096 elements a device; these norms of f32[2,16,32] a device are loop fusions that
    compute every operand inline. With the library's buffers at every reduction, the estimate
    said 182,272 B against XLA's 158,720 B (15% over); with them only where XLA makes them,
    153,984 B."""
    def norm(x, s, b):
        m = x.mean(-1, keepdims=True)
        return (x - m) * jax.lax.rsqrt(((x - m) ** 2).mean(-1, keepdims=True) + 1e-6) * s + b

    def loss(params, x):
        for p in params:
            y = jnp.swapaxes(norm(x, p["s1"], p["b1"]), 1, 2)
            x = x + jnp.swapaxes(jax.nn.gelu(y @ p["w1"]) @ p["w2"], 1, 2)
            x = x + jax.nn.gelu(norm(x, p["s2"], p["b2"]) @ p["w3"]) @ p["w4"]
        return (x * x).mean()

    def step(params, x):
        return jax.tree.map(lambda a, g: a - 0.1 * g, params, jax.grad(loss)(params, x))

    f32 = jnp.float32
    shapes = dict(s1=(32,), b1=(32,), w1=(16, 32), w2=(32, 16), s2=(32,), b2=(32,), w3=(32, 32), w4=(32, 32))
    params = [{k: jax.ShapeDtypeStruct(s, f32) for k, s in shapes.items()} for _ in range(2)]
    est, xla = _estimate_and_measure(step, (params, jax.ShapeDtypeStruct((16, 16, 32), f32)),
                                     [tactics.data_parallel("data")])
    assert abs(est / xla - 1) < 0.05, (est, xla)


def test_a_reduction_of_a_long_dim_reads_its_operand_from_a_buffer():
    """A sum over 64 features, f32[2,16,64] a device, trained: XLA:CPU rewrites a reduction of a
    dim longer than 32 into a reduce-window of 32, then a reduce, and fuses nothing into the
    reduce-window, so its operand (here ``sin(x * w)``, 8 KiB) is a buffer; too small for the
    library fusion (4,096 elements), the reduction is not one. Fused, the estimate said 8,896 B
    against XLA's 16,964 B (48% under); with the buffer, 16,576 B."""
    def step(w, x):
        return w - 0.1 * jax.grad(lambda w: (jnp.sin(x * w).sum(-1) ** 2).sum())(w)

    args = (jax.ShapeDtypeStruct((64,), jnp.float32), jax.ShapeDtypeStruct((16, 16, 64), jnp.float32))
    est, xla = _estimate_and_measure(step, args, [tactics.data_parallel("data")])
    assert abs(est / xla - 1) < 0.05, (est, xla)


def test_collectives_run_as_soon_as_their_operand_exists():
    """The corpus's NNX transformer under FSDP + Megatron: its forward's activations, split on the
    features, are moved onto the batch (all-to-alls) for the backward's weight gradients, and XLA
    runs each all-to-all right after the activation is made, holding the result until the
    backward (as it gathers a parameter at the start of the step). Resharded at their use, the
    estimate said 58,028 B against XLA's 75,148 B (23% under); as XLA schedules them, 70,316 B."""
    from automap.zoo import corpus

    w = corpus.BUILDERS["nnx_transformer"]()
    args = w.abstract()
    step = automap.automap(w.train_step, mesh=automap.make_mesh({"data": 2, "model": 4}),
                           tactics=[tactics.fsdp_tp()], search=None)
    est, xla = step.plan(*args).estimate.peak_memory_bytes, automap.measure(step.lower(*args).compile()).memory_per_device
    assert abs(est / xla - 1) < 0.1, (est, xla)


def _three_convs_step(ws, x):
    """A training step of three 1-D convolutions (kernels ``ws``, input ``x``), with tanh between."""
    def conv(x, w):
        return jax.lax.conv_general_dilated(x, w, (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC"))

    def loss(ws, x):
        h = jnp.tanh(x)
        for w in ws:
            h = jnp.tanh(conv(h, w))
        return (h ** 2).sum()

    gws, gx = jax.grad(loss, (0, 1))(ws, x)
    return [w - 0.1 * g for w, g in zip(ws, gws)], gx


_THREE_CONVS_ARGS = ([jax.ShapeDtypeStruct((3, 64, 64), jnp.float32)] * 3,
                     jax.ShapeDtypeStruct((64, 4, 64), jnp.float32))


def test_a_reversed_kernel_is_gathered_at_the_start_of_the_step():
    """Three 1-D convolutions trained under FSDP (each kernel split on its output features, the
    batch on ``data``): the input gradients read the kernels reversed, and XLA:CPU's breadth-first
    schedule reverses and gathers each at the start of the step, with the forward's gathers, so all
    are held through the forward. Gathered where the backward reverses them, the estimate said
    372,736 B against XLA's 430,200 B (13% under); gathered at the start, 421,888 B."""
    rules = [(r"^ws/", P(None, None, "data")), ("^x$", P("data"))]
    est, xla = _estimate_and_measure(_three_convs_step, _THREE_CONVS_ARGS, [tactics.manual(rules)])
    assert abs(est / xla - 1) < 0.05, (est, xla)


def test_an_early_gather_frees_the_shard_it_moved():
    """The three convolutions above on a 2x4 mesh, each kernel split on its input features over
    ``data``: the input gradients read the kernels reversed and whole, which XLA reaches in two
    steps (a collective-permute of a quarter to the ``model`` split, then a gather over ``model``),
    both at the start of the step. The moved quarter is freed once gathered; held with the gathered
    kernel through the forward, the estimate said 659,456 B against XLA's 507,960 B (1.30, outside
    the 25% target); freed, 622,592 B (1.23: the rest is the forward's elementwise values)."""
    rules = [(r"^ws/", P(None, "data", None)), ("^x$", P("data"))]
    step = automap.automap(_three_convs_step, mesh=automap.make_mesh({"data": 2, "model": 4}),
                           tactics=[tactics.manual(rules)], search=None)
    est = step.plan(*_THREE_CONVS_ARGS).estimate.peak_memory_bytes
    xla = automap.measure(step.lower(*_THREE_CONVS_ARGS).compile()).memory_per_device
    assert abs(est / xla - 1) < 0.25, (est, xla)


def test_a_strided_slices_gradient_pads_fuse_into_their_readers():
    """keras-hub GPT-OSS's biased expert MLP (gate and up interleaved along the features,
    ``gu[:, ::2]``, ``gu[:, 1::2]``), trained: each slice's gradient is a pad with interior
    padding, and XLA's loop fusion computes both pads and their sum in one kernel, whose buffer the
    weight gradient's dot and the bias gradient's sum read. Counted as a buffer each, their operands
    stored, the estimate said 378,880 B against XLA's 216,096 B (75% over; keras-hub GPT-OSS's
    data_parallel 1.23x XLA's memory); with the pads fused, 215,040 B."""
    def loss(w, b, x):
        gu = x @ w + b
        return (jnp.maximum(gu[:, ::2], 0.0) * gu[:, 1::2]).sum()

    def step(w, b, x):
        gw, gb = jax.grad(loss, (0, 1))(w, b, x)
        return w - 0.1 * gw, b - 0.1 * gb

    args = (jax.ShapeDtypeStruct((64, 256), jnp.float32), jax.ShapeDtypeStruct((256,), jnp.float32),
            jax.ShapeDtypeStruct((512, 64), jnp.float32))
    est, xla = _estimate_and_measure(step, args, [tactics.data_parallel("data")])
    assert abs(est / xla - 1) < 0.02, (est, xla)


def _attention_block(x, w):  # x (batch, 128, 16): causal attention over 4 heads, then a tanh MLP
    b, t, d = x.shape
    q, k, v = ((x @ w[i]).reshape(b, t, 4, d // 4) for i in range(3))
    x = x + jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, t, d)
    return x + jnp.tanh(x @ w[3]) @ w[4]


@pytest.mark.parametrize("batch", [64, 16])
def test_a_softmax_gradients_row_sum_fuses_the_scores_gradient_into_its_library_fusion(batch):
    """A scan over ``jax.checkpoint`` of an attention block (``jax.nn.dot_product_attention``),
    trained data parallel. With f32[1, 8, 4, 128, 128] scores a device (batch 64), XLA:CPU's
    YNNPACK fusion of the softmax gradient's row sum grows down through its negation and broadcast
    into the sum with the division it is added to, then up into the division and the scores
    gradient's dot: one fusion, whose result is the only buffer of that size. The estimate stored
    the dot's result and its unit-dim transpose (read by the row sum and by the division) side by
    side: 9,028,608 B against XLA's 7,182,640 (1.26x); now 7,180,288. With 2 sequences a device
    (batch 16) the row sum's f32[1, 2, 4, 128] result is a loop fusion's and XLA stores the
    division apart from the dot, as the estimate did and does (2,282,496 B against 2,274,608)."""
    def loss(ws, x):
        h, _ = jax.lax.scan(lambda h, w: (jax.checkpoint(_attention_block)(h, w), None), x, ws)
        return (h * h).sum()

    def step(ws, x):
        return ws - 0.1 * jax.grad(loss)(ws, x)

    args = (jax.ShapeDtypeStruct((2, 5, 16, 16), jnp.float32), jax.ShapeDtypeStruct((batch, 128, 16), jnp.float32))
    est, xla = _estimate_and_measure(step, args, [tactics.manual({"ws": P(), "x": P("data")})])
    assert abs(est / xla - 1) < 0.03, (est, xla)


def test_a_grouped_kernel_gradient_runs_over_its_groups_as_a_dilated_dim():
    """A 1-D conv over 128 channels in 16 groups of 8 (a 4-group conv vmapped over 4 ensemble
    members, nnx.vmap's), trained data-parallel: its kernel gradient is batch-grouped, and XLA:CPU
    expands only a depthwise one (a batch of exactly the groups) densely; this one it runs as an
    ungrouped conv over the groups as a base-dilated dim, on transposed copies of its input and
    its output's gradient. Counted as the dense expansion (the 12 KiB kernel 16 times over,
    twice), the estimate said 548,864 B against XLA's 286,720 B (1.91; the held-out nnx_ensemble
    probe's manual_dp 1.43); with the copies, 286,720 B."""
    def step(w, x):
        conv = lambda w: jax.lax.conv_general_dilated(x, w, (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC"),
                                                      feature_group_count=16)
        return w - 0.1 * jax.grad(lambda w: (jnp.tanh(conv(w)) ** 2).sum())(w)

    args = (jax.ShapeDtypeStruct((3, 8, 128), jnp.float32), jax.ShapeDtypeStruct((8, 16, 128), jnp.float32))
    est, xla = _estimate_and_measure(step, args, [tactics.data_parallel("data")])
    assert abs(est / xla - 1) < 0.05, (est, xla)
