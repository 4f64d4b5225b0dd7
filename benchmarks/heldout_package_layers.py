"""Held-out probe workloads for ``benchmarks/fidelity.py --workload``, built from equinox's and flax
nnx's layer libraries with layers that neither the corpus, the zoo nor ``heldout_flax_layers.py``
uses. ``eqx_rope``: ``eqx.nn.MultiheadAttention`` with ``eqx.nn.RotaryPositionalEmbedding`` applied
through ``process_heads``, ``eqx.nn.RMSNorm``, ``eqx.nn.Dropout`` in inference mode and an
``eqx.nn.MLP``; ``eqx_conv_gru``: ``eqx.nn.Conv2d`` x2 and ``eqx.nn.GroupNorm`` over an image, its
rows read by an ``eqx.nn.GRUCell`` under ``lax.scan``; ``nnx_lora``: ``nnx.LoRALinear``, per-head
``nnx.Einsum`` projections, ``nnx.RMSNorm``, a depthwise ``nnx.Conv`` and ``nnx.GroupNorm``;
``nnx_conv_bn``: ``nnx.LinearGeneral``, a causal dilated ``nnx.Conv``, ``nnx.BatchNorm`` on batch
statistics and ``nnx.Embed.attend``. equinox layers act on one example and run under ``jax.vmap``.
AdamW via the zoo's train step; batch 8, tokens (8, 16) of vocab 64 or images (8, 3, 8, 8), 8 classes.

    python benchmarks/fidelity.py --workload benchmarks/heldout_package_layers.py:eqx_rope \
        --workload benchmarks/heldout_package_layers.py:eqx_conv_gru \
        --workload benchmarks/heldout_package_layers.py:nnx_lora \
        --workload benchmarks/heldout_package_layers.py:nnx_conv_bn --episodes 16

Measured on jax 0.10.2, mesh 2x4 (32 plans): no plan fails; bytes sent outside 10% in 0, memory
outside 25% in 0, dot FLOPs outside 5% in 0; jit parity 0 of 12, the default dominated in 0 of 12
(4, 1 and 2 outside before a split's sliced dim was a permutation factor in ``automap.xla_layout``
and a scatter-add linked an indexed whole-width dim to its updates). Once outside:

- eqx_conv_gru (fixed since): jax.jit's programs, priced by ``automap.xla_layout``, were 0.83x
  (fsdp), 0.44x (fsdp_tp) and 0.46x (manual_fsdp) XLA's bytes sent, manual_fsdp 0.40x its memory,
  1.09x and 1.11x its dot FLOPs: the GRU's gates, 96 rows ``jnp.split`` into pieces of 32, passed
  their rows' split to the pieces before the dots' batch reached them, and the GRU's state was
  carried split on the hidden dim where XLA carries it batch-split (f32[1, 32]). Shardy's slice
  rule makes the sliced dim a permutation factor, which moves only in the rounds of every factor
  (``automap.xla_layout._split_as_shardy``): now 0.90 / 1.02 / 1.03 bytes sent, 0.90 / 0.99 / 0.77
  memory, dot FLOPs equal. XLA moves the split gates by collective-permutes (fsdp, 10.0 KiB): the
  (8, 96) gates whole on the batch, split on 'data', the pieces on ('data', 'model'); the
  estimate took that move as an all-to-all until :func:`automap.split_windows.pieces_windowed`
  let a dim the operand keeps whole be sliced locally (fsdp bytes sent 0.90 -> 0.95).
- eqx_rope fsdp_tp was bytes 0.85 (a plan without a loop that decided only its inputs: one program,
  priced by ``automap.xla_layout``), now 0.98 (memory 0.94 -> 0.98): the embedding gradient, the scatter-add of a vmapped ``weight[i]`` (every dim of the
  table indexed), did not link the table's whole-width feature dim to the updates' (Shardy's rule
  does: ``([k, m], [i, j, n], [i, j, l, m])->([k, m])``), so the updates took the batch split on
  ``data`` from the indices and passed it back through the RMSNorm and MLP cotangents into the
  forward residual stream, where XLA keeps the features on ``model`` alone (the MLP's input
  gradient all-reduced over ``data``, #247; the RMSNorm products gathered, #275, #361).
- On mesh 4x2, eqx_rope fsdp_tp was 0.89x XLA's dot FLOPs and nnx_conv_bn fsdp 0.94x (now 1.00
  both): a dot whose weight splits its rows as the result does (on 'data') and its sum over
  'model', the activation whole within each 'data' group, XLA gathers the weight over 'model'
  where the result has more elements than the weight (its base case's
  ``should_partition_contracting_dim``) and runs the sum whole; the estimate summed partial
  results (:func:`automap.whole_gathers.grouped_sum_gathers`). The activation's whole gather is
  shared with the weight gradient's (:func:`automap.gather_reuse.gathered_apart`), and a
  cotangent retiled from 'data' (4) onto 'model' (2) is permuted and gathered in pairs
  (:func:`automap.tile_order.disjoint_retile`): bytes sent 1.08 -> 0.97 and 0.91 -> 0.92.
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax

from automap.zoo.train import make_workload

B, T, V, H, C = 8, 16, 64, 32, 8
HEADS = 4
IMAGE = (3, 8, 8)  # one example's (channels, height, width), equinox's layout


def _fill(names, leaf, rng):
    return (rng.normal(size=leaf.shape) * 0.1).astype(leaf.dtype)


def _eqx_workload(name, build, batch_spec, make_batch, inputs):
    """A workload for the equinox model ``build(key)``: its float leaves are the parameters (the
    array half of ``eqx.partition``), the loss ``eqx.combine``s them with the static half and maps
    the model over the batch's ``inputs`` with ``jax.vmap``."""
    import equinox as eqx

    model = eqx.filter_eval_shape(build, jax.random.key(0))
    params, static = eqx.partition(
        model, lambda x: isinstance(x, jax.ShapeDtypeStruct) and jnp.issubdtype(x.dtype, jnp.inexact))

    def loss_fn(params, batch):
        logits = jax.vmap(eqx.combine(params, static))(batch[inputs])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()

    return make_workload(name, None, loss_fn=loss_fn, abstract_params=lambda: params, fill_param=_fill,
                         abstract_batch=lambda: batch_spec, make_batch=make_batch, learning_rate=1e-3)


def _token_batch():
    return {"tokens": jax.ShapeDtypeStruct((B, T), jnp.int32), "labels": jax.ShapeDtypeStruct((B,), jnp.int32)}


def _tokens(seed):
    rng = np.random.default_rng(seed)
    return {"tokens": rng.integers(0, V, (B, T)).astype(np.int32), "labels": rng.integers(0, C, (B,)).astype(np.int32)}


def _eqx_rope_model(key):
    import equinox as eqx

    class RopeClassifier(eqx.Module):
        """Embedding, a pre-norm causal attention block whose heads are rotated by RoPE, a SiLU MLP
        per token, mean-pooled into a linear head."""

        embed: eqx.nn.Embedding
        norm1: eqx.nn.RMSNorm
        attn: eqx.nn.MultiheadAttention
        rope: eqx.nn.RotaryPositionalEmbedding
        drop: eqx.nn.Dropout
        norm2: eqx.nn.RMSNorm
        mlp: eqx.nn.MLP
        head: eqx.nn.Linear

        def __init__(self, key):
            k_embed, k_attn, k_mlp, k_head = jax.random.split(key, 4)
            self.embed = eqx.nn.Embedding(V, H, key=k_embed)
            self.norm1 = eqx.nn.RMSNorm(H)
            self.attn = eqx.nn.MultiheadAttention(HEADS, H, key=k_attn)
            self.rope = eqx.nn.RotaryPositionalEmbedding(H // HEADS)
            self.drop = eqx.nn.Dropout(0.1, inference=True)
            self.norm2 = eqx.nn.RMSNorm(H)
            self.mlp = eqx.nn.MLP(H, H, 2 * H, depth=2, activation=jax.nn.silu, key=k_mlp)
            self.head = eqx.nn.Linear(H, C, key=k_head)

        def rotate(self, q, k, v):  # (seq, heads, head_dim): RoPE per head
            per_head = jax.vmap(self.rope, in_axes=1, out_axes=1)
            return per_head(q), per_head(k), v

        def __call__(self, tokens):  # tokens: (seq,)
            x = jax.vmap(self.embed)(tokens)
            h = jax.vmap(self.norm1)(x)
            mask = jnp.tril(jnp.ones((tokens.shape[0], tokens.shape[0]), bool))
            x = x + self.drop(self.attn(h, h, h, mask=mask, process_heads=self.rotate))
            x = x + jax.vmap(self.mlp)(jax.vmap(self.norm2)(x))
            return self.head(x.mean(axis=0))

    return RopeClassifier(key)


def _eqx_conv_gru_model(key):
    import equinox as eqx

    class ConvGRU(eqx.Module):
        """Two 3x3 convolutions (the second strided) with a group norm between, then a GRU over the
        feature map's rows (each row's channels x columns one input), its last state into a head."""

        conv1: eqx.nn.Conv2d
        norm: eqx.nn.GroupNorm
        conv2: eqx.nn.Conv2d
        gru: eqx.nn.GRUCell
        head: eqx.nn.Linear

        def __init__(self, key):
            keys = iter(jax.random.split(key, 4))
            self.conv1 = eqx.nn.Conv2d(IMAGE[0], 16, 3, padding=1, key=next(keys))
            self.norm = eqx.nn.GroupNorm(4, 16)
            self.conv2 = eqx.nn.Conv2d(16, 16, 3, stride=2, padding=1, key=next(keys))
            self.gru = eqx.nn.GRUCell(16 * IMAGE[2] // 2, H, key=next(keys))
            self.head = eqx.nn.Linear(H, C, key=next(keys))

        def __call__(self, image):  # image: (channels, height, width)
            x = jax.nn.relu(self.norm(self.conv1(image)))
            x = jax.nn.relu(self.conv2(x))  # (16, 4, 4)
            rows = x.transpose(1, 0, 2).reshape(x.shape[1], -1)

            def step(state, row):
                state = self.gru(row, state)
                return state, None

            state, _ = jax.lax.scan(step, jnp.zeros(H), rows)
            return self.head(state)

    return ConvGRU(key)


def _nnx_lora_model():
    from flax import nnx

    class LoRAMixer(nnx.Module):
        """``nnx.Embed``, a LoRA-adapted linear, per-head ``nnx.Einsum`` query/key/value and output
        projections around causal attention, a depthwise ``nnx.Conv`` over the sequence with
        ``nnx.GroupNorm``, mean-pooled into a LoRA-adapted head."""

        def __init__(self, rngs):
            self.embed = nnx.Embed(V, H, rngs=rngs)
            self.adapt = nnx.LoRALinear(H, H, lora_rank=4, rngs=rngs)
            self.norm = nnx.RMSNorm(H, rngs=rngs)
            self.qkv = nnx.Einsum("btd,sdhk->sbthk", (3, H, HEADS, H // HEADS), rngs=rngs)
            self.out = nnx.Einsum("bthk,hkd->btd", (HEADS, H // HEADS, H), (H,), rngs=rngs)
            self.conv = nnx.Conv(H, H, (3,), feature_group_count=H, rngs=rngs)
            self.group = nnx.GroupNorm(H, num_groups=4, rngs=rngs)
            self.head = nnx.LoRALinear(H, C, lora_rank=2, rngs=rngs)

        def __call__(self, tokens):
            x = nnx.gelu(self.adapt(self.embed(tokens)))
            q, k, v = self.qkv(self.norm(x))
            mask = nnx.make_causal_mask(tokens)
            x = x + self.out(nnx.dot_product_attention(q, k, v, mask=mask))
            x = x + nnx.relu(self.group(self.conv(x)))
            return self.head(x.mean(axis=1))

    return LoRAMixer


def _nnx_conv_bn_model():
    from flax import nnx

    class ConvBatchNorm(nnx.Module):
        """``nnx.Embed``, an ``nnx.LinearGeneral`` to (heads, head_dim) and back, a causal dilated
        ``nnx.Conv`` with ``nnx.BatchNorm`` in training mode (batch statistics: a mean over the
        batch), ``nnx.Dropout`` deterministic, logits by the embedding's ``attend`` (tied weights)."""

        def __init__(self, rngs):
            self.embed = nnx.Embed(V, H, rngs=rngs)
            self.split = nnx.LinearGeneral(H, (HEADS, H // HEADS), rngs=rngs)
            self.merge = nnx.LinearGeneral((HEADS, H // HEADS), H, axis=(-2, -1), rngs=rngs)
            self.conv = nnx.Conv(H, 2 * H, (3,), kernel_dilation=2, padding="CAUSAL", rngs=rngs)
            self.bn = nnx.BatchNorm(2 * H, rngs=rngs)
            self.drop = nnx.Dropout(0.1, deterministic=True)
            self.down = nnx.Linear(2 * H, H, rngs=rngs)

        def __call__(self, tokens):
            x = self.embed(tokens)
            x = x + self.merge(nnx.tanh(self.split(x)))
            x = x + self.down(self.drop(nnx.relu(self.bn(self.conv(x)))))
            return self.embed.attend(x.mean(axis=1))

    return ConvBatchNorm


def _nnx_workload(name, module):
    from flax import nnx

    graphdef, abstract_state = nnx.split(nnx.eval_shape(lambda: module(nnx.Rngs(0))))

    def loss_fn(params, batch):
        state = jax.tree.map(lambda x: x, abstract_state)
        nnx.replace_by_pure_dict(state, params)
        logits = nnx.merge(graphdef, state)(batch["tokens"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()

    return make_workload(name, None, loss_fn=loss_fn, abstract_params=lambda: nnx.to_pure_dict(abstract_state),
                         fill_param=_fill, abstract_batch=_token_batch, make_batch=_tokens, learning_rate=1e-3)


def eqx_rope():
    """The ``eqx_rope`` probe (equinox attention with rotary embeddings, RMSNorm, Dropout and an MLP over tokens): ``fidelity.py --workload benchmarks/heldout_package_layers.py:eqx_rope``."""
    return _eqx_workload("eqx_rope", _eqx_rope_model, _token_batch(), _tokens, "tokens")


def eqx_conv_gru():
    """The ``eqx_conv_gru`` probe (equinox Conv2d x2 and GroupNorm over an image, its rows read by a GRUCell under lax.scan): ``fidelity.py --workload benchmarks/heldout_package_layers.py:eqx_conv_gru``."""
    spec = {"image": jax.ShapeDtypeStruct((B, *IMAGE), jnp.float32), "labels": jax.ShapeDtypeStruct((B,), jnp.int32)}

    def make_batch(seed):
        rng = np.random.default_rng(seed)
        return {"image": rng.normal(size=(B, *IMAGE)).astype(np.float32),
                "labels": rng.integers(0, C, (B,)).astype(np.int32)}

    return _eqx_workload("eqx_conv_gru", _eqx_conv_gru_model, spec, make_batch, "image")


def nnx_lora():
    """The ``nnx_lora`` probe (nnx LoRALinear, per-head nnx.Einsum, RMSNorm, a depthwise Conv and GroupNorm over tokens): ``fidelity.py --workload benchmarks/heldout_package_layers.py:nnx_lora``."""
    return _nnx_workload("nnx_lora", _nnx_lora_model())


def nnx_conv_bn():
    """The ``nnx_conv_bn`` probe (nnx LinearGeneral, a causal dilated Conv, BatchNorm on batch statistics, Embed.attend): ``fidelity.py --workload benchmarks/heldout_package_layers.py:nnx_conv_bn``."""
    return _nnx_workload("nnx_conv_bn", _nnx_conv_bn_model())
