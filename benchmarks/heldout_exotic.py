"""Held-out probe workloads for ``benchmarks/fidelity.py --workload`` built from package code with
primitives and layers the other probes never use. ``unet``: a diffusion UNet block (``nn.Conv``,
``nn.GroupNorm``, ``nn.avg_pool`` down, ``jax.image.resize`` up, nearest and bilinear, a sinusoidal
timestep embedding, a skip concatenation), noise-prediction MSE; ``ssm``: a gated linear recurrence
(Mamba/S5-like: an input-dependent decay, ``jax.lax.associative_scan`` over the sequence, a
``jnp.cumsum`` running mean, a SiLU gate); ``fno``: a Fourier layer (``jnp.fft.rfft`` over the
sequence, a complex64 weight per kept mode, ``jnp.fft.irfft``), regression MSE; ``mixed_bf16``: an
nnx transformer block computing in bfloat16 on float32 parameters (``nnx.MultiHeadAttention``,
``nnx.LayerNorm``, ``nnx.Linear``, ``nnx.Embed``, all ``dtype=bfloat16, param_dtype=float32``);
``router``: top-2 routing over 4 dense experts (``jax.lax.top_k``, ``jax.nn.one_hot``,
``jnp.sort``, ``jnp.argsort`` with ``jnp.take_along_axis``, ``jax.ops.segment_sum`` for the load
loss); ``flax_rare``: ``nn.ConvLocal``, ``nn.WeightNorm`` around ``nn.Dense`` and ``nn.Einsum``.
AdamW via the zoo's train step; batch 8, tokens (8, 16) of vocab 64, 8 classes.

    python benchmarks/fidelity.py --episodes 16 --workload benchmarks/heldout_exotic.py:unet \\
        --workload benchmarks/heldout_exotic.py:ssm --workload benchmarks/heldout_exotic.py:fno \\
        --workload benchmarks/heldout_exotic.py:mixed_bf16 \\
        --workload benchmarks/heldout_exotic.py:router --workload benchmarks/heldout_exotic.py:flax_rare

Every primitive in them has a factor rule (none replicated around, none derived), and no plan
fails. Measured on jax 0.10.2 / flax 0.12.8, mesh 2x4 (48 plans): bytes sent outside 10% in 2,
memory outside 25% in 2, dot FLOPs outside 5% in 0; jit parity 0 of 18, the default dominated in
0 of 18; now 0 / 0 / 0 (after the router, fno and flax_rare fixes below; parity and dominated
unchanged). Before the estimate knew that XLA:CPU computes bfloat16 in float32,
mixed_bf16 alone had 3 / 5 / 0 outside (next, and the four left below):

- mixed_bf16 data_parallel, megatron_dp, fsdp, fsdp_tp, manual_fsdp memory 0.73, 0.66, 0.63, 0.63,
  0.58, now 1.06, 1.01, 0.95, 0.93, 0.90; fsdp, fsdp_tp, manual_fsdp bytes sent 0.84, 0.89, 0.50,
  now 0.98, 1.00, 0.96. XLA:CPU's float normalization computes every bf16 op in f32 and its
  simplifier drops the converts between them: the temporaries are f32 buffers (the estimate's
  bf16 activations, half the size, also fitted into the f32 parameters' output buffers: temp
  17.8 KiB against XLA's 153 KiB), a bf16 copy of a f32 parameter is gathered as the f32
  parameter, and a bf16 dot's partial sum wanted split is all-reduced whole in f32, then sliced
  (:func:`automap.cost.cpu_float32.computed_itemsize`, ``Traits.platform_unscattered``). With the
  first two alone, manual_fsdp bytes 0.73. Its default plan changed with the estimate: XLA's
  bytes sent 88.0 -> 72.9 KiB, memory 374.8 -> 207.3 KiB.
- router manual_fsdp bytes 0.67, now 1.00 (235.8 KiB, XLA's the same): the expert einsums' weights are split on their hidden
  features, the tokens on the batch, over the same axes. Forward, XLA gathers the tokens (the
  larger weight keeps its split, as ``automap.xla_layout`` has it); backward, it moves the hidden
  activations' cotangent to the batch by all-to-alls (4 x 16 KiB), gathers both weights again
  (2 x 32 KiB) and the (4, 32, 8, 16) hidden values (64 KiB), and reduce-scatters the weight
  gradient, where the estimate keeps the cotangent on the features and reduce-scatters the token
  gradient (16 KiB): a Shardy ordering in the backward that ``automap.xla_layout`` did not follow.
  The outer product ``bth,bte->bthe`` of the backward was taken as a pass-through op, whose
  operands, holding fewer factors, proposed nothing before the last round; a contraction now
  propagates with the other dots (``automap.xla_layout._pass_through``).
- flax_rare default bytes 1.13, now 1.00: ``nn.ConvLocal`` extracts patches with an identity-kernel
  convolution; the default plan splits the sequence, which XLA keeps split with a halo exchange
  (2 collective-permutes, 2 KiB) where the conv rule kept overlapping windows whole and gathered
  (12 KiB). A conv's overlapping-window dims now share their split with the output
  (:func:`automap.rules.conv_windows.windowed_spatial_dims`), their halos priced as XLA's
  collective-permutes (:mod:`automap.conv_halos`). The default plan changed with the estimate
  (the old one, expert_parallel + megatron + sequence_parallel on 'model', now estimated 0.496 ms
  where it said 0.513): the arbiter's next best, ``local``'s positions on 'data', estimated
  0.410 ms; XLA's bytes sent 75.6 -> 47.4 KiB, memory 396.9 -> 752.0 KiB (within the 4 GiB
  budget; memory ratio 1.09 -> 1.13, dot FLOPs 1.04 -> 1.00).
- fno fsdp memory 0.71, now 1.00 (191.8 KiB against XLA's 190.9 KiB; fsdp_tp 0.96 -> 1.01,
  manual_fsdp 0.86 -> 1.01): XLA:CPU combines only
  all-reduces of one element type, so the two spectral layers' complex64 weight gradients (32 KiB
  each) go in one all-reduce, apart from their norms' float32 sums, where the estimate kept them
  apart as a float32 gradient summed again into the norm is
  (:func:`automap.cost.schedule.combined_reductions`). The FFTs run whole (``runs_whole``:
  gathered, transformed, sliced).
- unet fsdp_tp memory 1.27 (temp 697 KiB, XLA's 421 KiB), now 1.20: XLA fuses the nearest-neighbour
  upsampling's gathers into the concatenation with the skip, no buffer of their own (the estimate
  stored them: ``automap.cost.bufferless_lookups.fused_lookups``; the other unet plans 1.05-1.12 -> 1.04-1.09).
  Left: XLA's weight-gradient conv of ``conv_up`` reads a transposed copy of half the concatenated
  channels (48 KiB), made after the forward conv, where the estimate copies all of them (96 KiB) at
  the concatenation.
"""
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from automap.zoo.train import make_workload

B, T, V, H, C = 8, 16, 64, 32, 8
HEADS, EXPERTS, MODES = 4, 4, 4
IMAGE = (8, 8, 4)  # one example's (height, width, channels), flax's layout


def _fill(names, leaf, rng):
    if jnp.issubdtype(leaf.dtype, jnp.complexfloating):
        return ((rng.normal(size=leaf.shape) + 1j * rng.normal(size=leaf.shape)) * 0.1).astype(leaf.dtype)
    if names[-1] == "scale":
        return np.ones(leaf.shape, leaf.dtype)
    return (rng.normal(size=leaf.shape) * 0.1).astype(leaf.dtype)


def _tokens(seed):
    """Tokens (B, T) of vocab V and a label of C classes per sequence."""
    rng = np.random.default_rng(seed)
    return {"tokens": rng.integers(0, V, (B, T), dtype=np.int32), "labels": rng.integers(0, C, (B,), dtype=np.int32)}


def _token_batch():
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), _tokens(0))


def _classify(model):
    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["tokens"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()

    return loss_fn


def _linen_workload(name, model, inputs, loss_fn, batch_spec=_token_batch, make_batch=_tokens):
    def abstract_params():
        example = [jnp.zeros(batch_spec()[k].shape, batch_spec()[k].dtype) for k in inputs]
        return jax.eval_shape(lambda: model.init(jax.random.key(0), *example))["params"]

    return make_workload(name, None, loss_fn=loss_fn, abstract_params=abstract_params, fill_param=_fill,
                         abstract_batch=batch_spec, make_batch=make_batch, learning_rate=1e-3)


# --- unet ------------------------------------------------------------------------------------------


def timestep_embedding(t, dim):
    """The sinusoidal embedding of diffusion timesteps ``t`` (batch,) into ``dim`` features."""
    freqs = jnp.exp(-math.log(10_000.0) * jnp.arange(dim // 2, dtype=jnp.float32) / (dim // 2))
    angles = t.astype(jnp.float32)[:, None] * freqs[None, :]
    return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)


class UNetBlock(nn.Module):
    """Conv + GroupNorm down to half resolution by ``nn.avg_pool``, the timestep embedding added,
    nearest-neighbour upsampling concatenated with the skip, a bilinear-upsampled side branch."""

    @nn.compact
    def __call__(self, image, t):
        temb = nn.Dense(2 * H, name="temb2")(nn.swish(nn.Dense(H, name="temb1")(timestep_embedding(t, H))))
        skip = nn.swish(nn.GroupNorm(num_groups=4, name="gn1")(nn.Conv(H, (3, 3), name="conv_in")(image)))
        h = nn.avg_pool(skip, (2, 2), strides=(2, 2))
        h = nn.Conv(2 * H, (3, 3), name="conv_mid")(h) + temb[:, None, None, :]
        h = nn.swish(nn.GroupNorm(num_groups=8, name="gn2")(h))
        b, hh, ww, _ = skip.shape
        up = jax.image.resize(h, (b, hh, ww, h.shape[-1]), "nearest")
        x = nn.Conv(H, (3, 3), name="conv_up")(jnp.concatenate([up, skip], axis=-1))
        side = jax.image.resize(nn.Conv(H, (1, 1), name="side")(h), (b, hh, ww, H), "bilinear")
        x = nn.swish(nn.GroupNorm(num_groups=4, name="gn3")(x + side))
        return nn.Conv(IMAGE[-1], (3, 3), name="conv_out")(x)


def unet():
    """The ``unet`` probe (a diffusion UNet block): ``fidelity.py --workload benchmarks/heldout_exotic.py:unet``."""
    model = UNetBlock()

    def spec():
        image = jax.ShapeDtypeStruct((B, *IMAGE), jnp.float32)
        return {"image": image, "t": jax.ShapeDtypeStruct((B,), jnp.int32), "noise": image}

    def make_batch(seed):
        rng = np.random.default_rng(seed)
        return {"image": rng.normal(size=(B, *IMAGE)).astype(np.float32),
                "t": rng.integers(0, 1000, (B,)).astype(np.int32),
                "noise": rng.normal(size=(B, *IMAGE)).astype(np.float32)}

    def loss_fn(params, batch):
        noisy = batch["image"] + batch["noise"]
        return jnp.mean((model.apply({"params": params}, noisy, batch["t"]) - batch["noise"]) ** 2)

    return _linen_workload("unet", model, ("image", "t"), loss_fn, spec, make_batch)


# --- ssm -------------------------------------------------------------------------------------------


def _linear_recurrence(decay, inputs, axis):
    """``h[t] = decay[t] * h[t - 1] + inputs[t]`` along ``axis`` by an associative scan."""

    def combine(left, right):
        a_l, b_l = left
        a_r, b_r = right
        return a_l * a_r, a_r * b_l + b_r

    return jax.lax.associative_scan(combine, (decay, inputs), axis=axis)[1]


class GatedSSM(nn.Module):
    """A Mamba/S5-like layer: input and gate projections, an input-dependent decay in (0, 1), the
    linear recurrence by ``associative_scan``, a ``cumsum`` running mean, a SiLU gate, twice."""

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(V, H, name="embed")(tokens)
        for i in range(2):
            h = nn.LayerNorm(name=f"norm{i}")(x)
            u, gate = jnp.split(nn.Dense(2 * H, name=f"in{i}")(h), 2, axis=-1)
            decay = nn.sigmoid(nn.Dense(H, name=f"decay{i}")(h))
            state = _linear_recurrence(decay, (1 - decay) * u, axis=1)
            running = jnp.cumsum(u, axis=1) / jnp.arange(1, T + 1, dtype=u.dtype)[None, :, None]
            x = x + nn.Dense(H, name=f"out{i}")((state + running) * nn.silu(gate))
        return nn.Dense(C, name="head")(x.mean(axis=1))


def ssm():
    """The ``ssm`` probe (a gated linear recurrence by associative_scan and cumsum): ``fidelity.py --workload benchmarks/heldout_exotic.py:ssm``."""
    model = GatedSSM()
    return _linen_workload("ssm", model, ("tokens",), _classify(model))


# --- fno -------------------------------------------------------------------------------------------


class SpectralConv(nn.Module):
    """An FNO Fourier layer: ``rfft`` over the sequence, the lowest ``MODES`` modes mixed by a
    complex64 weight per mode, ``irfft`` back, plus a pointwise ``nn.Dense``."""

    width: int

    @nn.compact
    def __call__(self, x):  # (batch, seq, width)
        def init(key, shape):
            re, im = jax.random.normal(key, (2, *shape)) / self.width
            return jax.lax.complex(re, im)

        weight = self.param("spectral", init, (MODES, self.width, self.width))
        modes = jnp.fft.rfft(x, axis=1)[:, :MODES]
        mixed = jnp.einsum("bmi,mio->bmo", modes, weight)
        spectrum = jnp.zeros((x.shape[0], x.shape[1] // 2 + 1, self.width), mixed.dtype).at[:, :MODES].set(mixed)
        return jnp.fft.irfft(spectrum, n=x.shape[1], axis=1) + nn.Dense(self.width, name="pointwise")(x)


class FNO(nn.Module):
    @nn.compact
    def __call__(self, signal):  # (batch, seq, channels)
        x = nn.Dense(H, name="lift")(signal)
        for i in range(2):
            x = nn.gelu(SpectralConv(H, name=f"fourier{i}")(x))
        return nn.Dense(1, name="project")(nn.gelu(nn.Dense(H, name="hidden")(x)))[..., 0]


def fno():
    """The ``fno`` probe (a Fourier neural operator: rfft, complex weights, irfft): ``fidelity.py --workload benchmarks/heldout_exotic.py:fno``."""
    model = FNO()

    def spec():
        return {"signal": jax.ShapeDtypeStruct((B, T, 4), jnp.float32), "target": jax.ShapeDtypeStruct((B, T), jnp.float32)}

    def make_batch(seed):
        rng = np.random.default_rng(seed)
        signal = rng.normal(size=(B, T, 4)).astype(np.float32)
        return {"signal": signal, "target": np.cumsum(signal.sum(-1), axis=1).astype(np.float32) / T}

    def loss_fn(params, batch):
        return jnp.mean((model.apply({"params": params}, batch["signal"]) - batch["target"]) ** 2)

    return _linen_workload("fno", model, ("signal",), loss_fn, spec, make_batch)


# --- mixed_bf16 ------------------------------------------------------------------------------------


def _mixed_model():
    from flax import nnx

    mixed = dict(dtype=jnp.bfloat16, param_dtype=jnp.float32)

    class MixedBlock(nnx.Module):
        """Embedding, a pre-norm causal ``nnx.MultiHeadAttention`` block and a GELU MLP in bfloat16
        on float32 parameters; the logits cast back to float32 for the loss."""

        def __init__(self, rngs):
            self.embed = nnx.Embed(V, H, rngs=rngs, **mixed)
            self.norm1 = nnx.LayerNorm(H, rngs=rngs, **mixed)
            self.attn = nnx.MultiHeadAttention(HEADS, H, decode=False, rngs=rngs, **mixed)
            self.norm2 = nnx.LayerNorm(H, rngs=rngs, **mixed)
            self.up = nnx.Linear(H, 4 * H, rngs=rngs, **mixed)
            self.down = nnx.Linear(4 * H, H, rngs=rngs, **mixed)
            self.head = nnx.Linear(H, C, rngs=rngs, **mixed)

        def __call__(self, tokens):
            x = self.embed(tokens)
            x = x + self.attn(self.norm1(x), mask=nnx.make_causal_mask(tokens))
            x = x + self.down(nnx.gelu(self.up(self.norm2(x))))
            return self.head(x.mean(axis=1)).astype(jnp.float32)

    return MixedBlock


def mixed_bf16():
    """The ``mixed_bf16`` probe (an nnx transformer block in bfloat16 on float32 parameters): ``fidelity.py --workload benchmarks/heldout_exotic.py:mixed_bf16``."""
    from flax import nnx

    graphdef, abstract_state = nnx.split(nnx.eval_shape(lambda: _mixed_model()(nnx.Rngs(0))))

    def loss_fn(params, batch):
        state = jax.tree.map(lambda x: x, abstract_state)
        nnx.replace_by_pure_dict(state, params)
        logits = nnx.merge(graphdef, state)(batch["tokens"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()

    return make_workload("mixed_bf16", None, loss_fn=loss_fn, abstract_params=lambda: nnx.to_pure_dict(abstract_state),
                         fill_param=_fill, abstract_batch=_token_batch, make_batch=_tokens, learning_rate=1e-3)


# --- router ----------------------------------------------------------------------------------------


class Router(nn.Module):
    """Top-2 routing over dense experts: ``top_k`` of the router logits, their softmax spread over
    the experts by ``one_hot``, each expert an MLP on every token; tokens reordered by confidence
    (``argsort`` + ``take_along_axis``), the top-two margin from ``sort``, and a load loss from
    ``segment_sum`` of the chosen experts (returned with the logits)."""

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(V, H, name="embed")(tokens)
        logits = nn.Dense(EXPERTS, name="router")(x)  # (batch, seq, experts)
        top, chosen = jax.lax.top_k(logits, 2)
        gates = jnp.sum(jax.nn.softmax(top)[..., None] * jax.nn.one_hot(chosen, EXPERTS), axis=-2)
        w_in = self.param("w_in", nn.initializers.lecun_normal(), (EXPERTS, H, 2 * H))
        w_out = self.param("w_out", nn.initializers.lecun_normal(), (EXPERTS, 2 * H, H))
        hidden = nn.gelu(jnp.einsum("bth,ehf->btef", x, w_in))
        x = x + jnp.einsum("btef,efh,bte->bth", hidden, w_out, gates)
        ranked = jnp.sort(logits, axis=-1)
        margin = ranked[..., -1] - ranked[..., -2]  # (batch, seq)
        order = jnp.argsort(-margin, axis=1)
        confident = jnp.take_along_axis(x, order[..., None], axis=1)[:, : T // 2]
        load = jax.ops.segment_sum(jnp.ones(chosen.size), chosen.reshape(-1), num_segments=EXPERTS)
        balance = jnp.sum(load / chosen.size * jax.nn.softmax(logits).mean(axis=(0, 1)))
        return nn.Dense(C, name="head")(confident.mean(axis=1)), balance


def router():
    """The ``router`` probe (top_k, one_hot, sort, argsort, take_along_axis, segment_sum): ``fidelity.py --workload benchmarks/heldout_exotic.py:router``."""
    model = Router()

    def loss_fn(params, batch):
        logits, balance = model.apply({"params": params}, batch["tokens"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean() + 0.01 * balance

    return _linen_workload("router", model, ("tokens",), loss_fn)


# --- flax_rare -------------------------------------------------------------------------------------


class FlaxRare(nn.Module):
    """``nn.ConvLocal`` (unshared kernels per position) over the embedding, ``nn.WeightNorm`` of an
    ``nn.Dense``, an ``nn.Einsum`` to heads and back."""

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(V, H, name="embed")(tokens)
        x = x + nn.relu(nn.ConvLocal(H, (3,), padding="SAME", name="local")(x))
        x = x + nn.gelu(nn.WeightNorm(nn.Dense(H, name="dense"), name="wn")(x))
        heads = nn.Einsum((H, HEADS, H // HEADS), "btd,dhk->bthk", name="split")(x)
        x = x + nn.Einsum((HEADS, H // HEADS, H), "bthk,hkd->btd", name="merge")(nn.tanh(heads))
        return nn.Dense(C, name="head")(x.mean(axis=1))


def flax_rare():
    """The ``flax_rare`` probe (nn.ConvLocal, nn.WeightNorm, nn.Einsum): ``fidelity.py --workload benchmarks/heldout_exotic.py:flax_rare``."""
    model = FlaxRare()
    return _linen_workload("flax_rare", model, ("tokens",), _classify(model))
