"""Held-out probe workloads for ``benchmarks/fidelity.py --workload``: models built from flax's own
layers that neither the corpus nor the zoo uses. ``lstm``: ``nn.RNN(nn.OptimizedLSTMCell)`` then
``nn.RNN(nn.GRUCell)`` (two scans) over an ``nn.Embed``, mean-pooled into an ``nn.Dense`` head;
``conv1d``: ``nn.Conv`` x2, ``nn.GroupNorm`` and ``nn.max_pool`` over an embedding;
``attention_sdpa`` and ``conv_up`` (their classes' docstrings). Adam via the zoo's train step;
tokens (8, 16), vocab 64, width 32, 8 classes.

    python benchmarks/fidelity.py --workload benchmarks/heldout_flax_layers.py:lstm \
        --workload benchmarks/heldout_flax_layers.py:conv1d \
        --workload benchmarks/heldout_flax_layers.py:attention_sdpa \
        --workload benchmarks/heldout_flax_layers.py:conv_up --episodes 16

Measured on jax 0.10.2, mesh 2x4 (32 plans): bytes sent outside 10% in 0 (lstm fsdp, below, was
the 1), memory outside 25% in 0
(conv1d manual_fsdp 0.64 and conv_up manual_fsdp 0.68 before the estimate followed XLA:CPU's
breadth-first schedule, which gathers the input gradients' reversed kernels at the start of the
step, next to the forward's: :func:`automap.cost.schedule.breadth_first_starts`, now 0.88 and
0.93; conv_up fsdp_tp 1.21 -> 1.17 and conv1d fsdp_tp 1.16 -> 1.14 once the shard each early
gather moved is freed when gathered, :func:`automap.cost.memory._reshard_spans`), dot FLOPs outside 5% in 0; jit parity 0 of 12, the default dominated in 0 of 12. lstm fsdp
sends 0.98x XLA's bytes (1.01x before the two corrections below; 0.86x before the estimate priced a split's pieces as XLA moves them,
:mod:`automap.split_moves`; 0.91x before a split's sliced dim was a permutation factor in
``automap.xla_layout``, which laid the input kernel's weight gradient in the backward scan out
as XLA does, ((), 'model'), where it had the hidden kernel's ('model', 'data')). Its split (#273)
wants the pieces on ('data', 'model'), the transposed gradient on ('model', -): XLA reshards it to
the pieces' layout and moves each piece's share by twelve collective-permutes (136 KiB over the
16 steps), which the estimate priced as one all-to-all per piece (12 KiB). The reshard from
('model', -) to ('data', 'model') before it, an all-to-all over half of 'model' and a permute to
XLA, was one all-to-all to the estimate (28 KiB short; :func:`automap.tile_order.displaced_axes`),
and the gradient's all-reduce over 'data' (#270, 64 KiB) is a reduce-scatter to XLA's measure
(32 KiB), the split keeping each device's rows (:func:`automap.merged_slices.sliced_once`); the two
errors cancelled (1.01x), each now priced as XLA sends it (0.95x with the second alone). Before the loop's
carry was laid out as Shardy lays it out (:mod:`automap.xla_loops`), lstm fsdp was 2.70 bytes and
0.67 FLOPs, fsdp_tp 1.51 bytes; before convolutions were sized as Shardy sizes them
(:mod:`automap.shardy_sizes`), conv1d fsdp_tp 0.63 and manual_fsdp 0.52 bytes; before a transposed
conv's kernel gradient was counted as XLA:CPU runs it, conv_up 1.12 FLOPs on every plan.

On mesh 4x2 lstm fsdp sends 0.99x XLA's bytes (1.14 before :func:`automap.merged_slices.sliced_once`,
1.09 before :mod:`automap.split_moves`): its splits are priced as XLA sends them (#273 64 KiB on
both sides), and the gradient's all-reduce over 'data' (#270, 4 devices: 200 KiB estimated) as
the reduce-scatter XLA's measure reads, the split keeping each device's rows (as on 2x4).

On mesh 4x2 (``--mesh 4x2``) conv1d fsdp_tp was outside, bytes 0.84 (67.7 KiB against 81.0), now
1.00 (80.7 KiB). Its layout is Shardy's, op for op, but the embedding's scatter-add (#176: the
table on (model, data), the indices on data, the updates' features on data) runs as XLA's
partitioner runs it: the indices cannot stay on data (the features hold it), so they move onto the
rows' axis, model, the updates are sliced there, each device adds into the whole rows and the
table is reduce-scattered over model (1.0 KiB; :func:`automap.indexed_ops._rows_on_the_indices`).
That slice falls on conv1's input gradient (#174, the 64 channels contracted on data into a result
kept on data along its 32 channels), and XLA:CPU's simplifier merges it with the reduce-scatter's
own slice into one that keeps an eighth: the sum stays an all-reduce, 24.0 KiB where the estimate
had a 12.0 KiB reduce-scatter (:mod:`automap.merged_slices`). conv_up fsdp is outside, bytes 0.83:
its scatter-add (the table on (data, model), the indices on (data, model), the updates' features
on model) keeps model on the features in the estimate (XLA does so on mesh 2x4), where on 4x2 XLA
moves the updates' model split onto the tokens (an all-to-all) and reduce-scatters the whole 8 KiB
table over both axes; left as it is.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from automap.zoo.train import make_workload

B, T, V, H, C = 8, 16, 64, 32, 8


class LSTMClassifier(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(V, H, name="embed")(tokens)
        x = nn.RNN(nn.OptimizedLSTMCell(H), name="rnn")(x)
        x = nn.RNN(nn.GRUCell(H), name="gru")(x)
        return nn.Dense(C, name="head")(x.mean(axis=1))


class Conv1D(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(V, H, name="embed")(tokens)
        x = nn.relu(nn.Conv(2 * H, (3,), name="conv1")(x))
        x = nn.GroupNorm(num_groups=4, name="gn")(x)
        x = nn.relu(nn.Conv(H, (3,), strides=(2,), name="conv2")(x))
        x = nn.max_pool(x, (2,), strides=(2,))
        return nn.Dense(C, name="head")(x.reshape(x.shape[0], -1))


class AttentionSDPA(nn.Module):
    """Two pre-norm blocks: ``nn.RMSNorm``, ``nn.DenseGeneral`` heads, ``jax.nn.dot_product_attention``
    (causal), a GELU MLP; positions by ``jnp.cumsum``."""

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(V, H, name="embed")(tokens)
        x = x + nn.Embed(T + 1, H, name="pos")(jnp.cumsum(jnp.ones_like(tokens), axis=1))
        for i in range(2):
            h = nn.RMSNorm(name=f"norm{i}")(x)
            q, k, v = (nn.DenseGeneral((4, H // 4), name=f"{n}{i}")(h) for n in "qkv")
            a = jax.nn.dot_product_attention(q, k, v, is_causal=True)
            x = x + nn.DenseGeneral(H, axis=(-2, -1), name=f"o{i}")(a)
            h = nn.RMSNorm(name=f"mnorm{i}")(x)
            x = x + nn.Dense(H, name=f"down{i}")(nn.gelu(nn.Dense(4 * H, name=f"up{i}")(h)))
        return nn.Dense(C, name="head")(x.mean(axis=1))


class ConvUp(nn.Module):
    """A strided ``nn.Conv`` down, ``nn.ConvTranspose`` up, ``nn.LayerNorm``, ``nn.avg_pool``,
    ``jax.image.resize`` and ``lax.top_k``."""

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(V, H, name="embed")(tokens)
        x = nn.swish(nn.Conv(H, (3,), strides=(2,), name="down")(x))
        x = nn.ConvTranspose(H, (3,), strides=(2,), name="up")(x)
        x = nn.avg_pool(nn.LayerNorm(name="ln")(x), (2,), strides=(2,))
        x = jax.image.resize(x, (x.shape[0], T, H), "linear")
        top = jax.lax.top_k(x.mean(-1), 4)[0]
        return nn.Dense(C, name="head")(jnp.concatenate([x.max(axis=1), top], axis=-1))


def _workload(name, model):
    batch_spec = {"tokens": jax.ShapeDtypeStruct((B, T), jnp.int32), "labels": jax.ShapeDtypeStruct((B,), jnp.int32)}

    def abstract_params():
        return jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((B, T), jnp.int32)))["params"]

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["tokens"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()

    def make_batch(seed):
        rng = np.random.default_rng(seed)
        return {"tokens": rng.integers(0, V, (B, T)).astype(np.int32), "labels": rng.integers(0, C, (B,)).astype(np.int32)}

    return make_workload(name, None, loss_fn=loss_fn, abstract_params=abstract_params,
                         fill_param=lambda names, leaf, rng: (rng.normal(size=leaf.shape) * 0.1).astype(leaf.dtype),
                         abstract_batch=lambda: batch_spec, make_batch=make_batch, learning_rate=1e-3)


def lstm():
    return _workload("lstm", LSTMClassifier())


def conv1d():
    return _workload("conv1d", Conv1D())


def attention_sdpa():
    return _workload("attention_sdpa", AttentionSDPA())


def conv_up():
    return _workload("conv_up", ConvUp())
