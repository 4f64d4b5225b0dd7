"""Held-out probe workloads for ``benchmarks/fidelity.py --workload``: stacks of layers scanned as
real code scans them, each with its package's own stacking idiom (the other held-out probes are
one block, unrolled). ``linen_mixer_scan``: an MLP-mixer block (token mixing over the sequence,
channel mixing over the features, ``nn.LayerNorm``) under ``nn.remat`` then ``nn.scan``
(``variable_axes={'params': 0}``, ``split_rngs={'params': True}``); ``nnx_scan``: a pre-norm
attention block (``nnx.LayerNorm``, ``nnx.Linear`` heads, ``nnx.dot_product_attention``, a GELU
MLP) created ``nnx.vmap``-ped over split rngs and run by ``nnx.scan`` of an ``nnx.remat``-ed call
(flax's "scan over layers" pattern); ``eqx_scan``: an equinox block (``eqx.nn.LayerNorm``,
``eqx.nn.MultiheadAttention``, ``eqx.nn.MLP``) stacked by ``eqx.filter_vmap(make_layer)(keys)``
and run by ``jax.lax.scan`` over the stacked arrays, ``eqx.combine``-d with the static half in
the body (equinox's pattern); ``hk_layer_stack``: a haiku block (``hk.RMSNorm``, causal
``hk.MultiHeadAttention``, a SwiGLU of ``hk.Linear``) under ``hk.layer_stack``. Three layers,
tokens (8, 16) of vocab 64, width 32, 8 classes, AdamW via the zoo's train step.

``eqx_scan_long`` and ``nnx_scan_long`` are the same models on a long sequence of a large batch at
a small width (tokens (16, 128), width 16, 4 layers), so that the activations the backward reads
outweigh the parameters, as in a real training run: the case for recomputation
(``benchmarks/remat.py --workload``); nnx_scan_long runs its blocks without ``nnx.remat``,
``nnx_scan_long_remat`` with it. dm-haiku is not a project dependency: ``pip install dm-haiku``
to run ``hk_layer_stack``.

    python benchmarks/fidelity.py --episodes 16 --workload benchmarks/heldout_scanned.py:linen_mixer_scan
    python benchmarks/remat.py --workload benchmarks/heldout_scanned.py:eqx_scan_long

Measured on jax 0.10.2, flax 0.12.8, equinox 0.13.8, dm-haiku 0.0.17, mesh 2x4, 16 episodes, one
workload per run (32 plans): no plan fails and no primitive lacks a rule; bytes sent, memory and
dot FLOPs outside target in 0 / 0 / 0; jit parity 0 of 12, the default dominated in 0 of 12
(estimate / XLA: bytes 0.98-1.01, memory 0.88-1.14, FLOPs 1.00; linen_mixer_scan and nnx_scan
measured before the fix below, eqx_scan and hk_layer_stack again after it: their tactic plans'
memory 0.88-0.98 and 0.91-0.99, was 0.95-1.03 and 0.97-1.04). Mesh 4x2, eqx_scan: 0 / 0 / 0
(memory 0.88-1.05). nnx_scan_long_remat (nnx_scan_long with its ``nnx.remat``), all 8 plans:
memory 0.95-1.01 (bytes and FLOPs 1.00); data_parallel, megatron_dp, fsdp_tp, manual_megatron_dp
were 1.20, 1.24, 1.26, 1.20 before the backward body's softmax-gradient row sum took the scores
gradient's dot into its library fusion (:func:`automap.cost.unfused_operands.library_consumers`):
the estimate held the dot's result and its unit-dim transpose, 2 MiB each a device, side by side
(body peak 8,876,032 B, XLA's whole temp 7,679,704 B).
eqx_scan_long and nnx_scan_long, the four tactic plans: memory 0.97-0.99, bytes 1.00-1.04.

``remat.py`` (budget 0.8x the smallest XLA-measured expert plan): eqx_scan_long fits, 0.401x the
budget by XLA's measure (2,740,108 B; estimated 3,325,656 B), recomputing the scan body
selectively, loss rel. diff 2.3e-07; nnx_scan_long fits, 0.477x (3,249,020 B; estimated 3,815,124
B), loss equal; eqx_scan 0.632x and hk_layer_stack 0.804x fit (selective recomputation, losses
equal); linen_mixer_scan and nnx_scan find no plan (``MemoryBudgetError``: 118.7 KiB explored
against 99.5 KiB, 222.0 against 190.4): on those two the state and the user's own ``remat``
leave nothing to recompute that 20% would come from (forward residuals 0.7x and 1.2x the
parameters). nnx_scan_long_remat has none either (2.3 MiB against 1.8):
the user's remat already recomputes the whole block and fsdp splits the attention scores over
all 8 devices. Activations against parameters (the forward scan's stacked residuals / the
parameters' bytes): eqx_scan_long 943x (52.9 MB / 56 KB), nnx_scan_long 927x (10x with the
user's remat: its forward keeps only the carry), eqx_scan 12.4x, nnx_scan 1.2x, linen_mixer_scan 0.7x.

eqx_scan_long's recomputing plan was estimated 2.66x XLA's memory (6,758,712 B against 2,544,524)
before a scan operand the body never reads held no memory (:attr:`automap.ir.program.Op.
unread_operands`): JAX hoists the masking splat of ``jnp.where(mask, s, finfo.min)`` (a
loop-invariant residual, f32[16, 4, 128, 128], 4 MiB replicated) out of the forward scan and
passes it to the backward scan, whose body does not read it; XLA drops it from the loop state.
The estimate now lets the search keep the weight matmuls (selective recomputation) where it
recomputed the whole body.
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax

from automap.zoo.train import make_workload

V, C, HEADS = 64, 8, 4
SMALL = dict(batch=8, seq=16, width=32, layers=3)
LONG = dict(batch=16, seq=128, width=16, layers=4)


def _fill(names, leaf, rng):
    return (rng.normal(size=leaf.shape) * 0.1).astype(leaf.dtype)


def _token_workload(name, size, loss_fn, abstract_params):
    """A workload of ``loss_fn(params, batch)`` on tokens ``(batch, seq)`` of vocab ``V`` with
    ``C`` class labels."""
    batch, seq = size["batch"], size["seq"]
    spec = {"tokens": jax.ShapeDtypeStruct((batch, seq), jnp.int32),
            "labels": jax.ShapeDtypeStruct((batch,), jnp.int32)}

    def make_batch(seed):
        rng = np.random.default_rng(seed)
        return {"tokens": rng.integers(0, V, (batch, seq)).astype(np.int32),
                "labels": rng.integers(0, C, (batch,)).astype(np.int32)}

    return make_workload(name, None, loss_fn=loss_fn, abstract_params=abstract_params, fill_param=_fill,
                         abstract_batch=lambda: spec, make_batch=make_batch, learning_rate=1e-3)


def _xent(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()


def _linen_mixer(size):
    import flax.linen as nn

    seq, width, layers = size["seq"], size["width"], size["layers"]

    class MixerBlock(nn.Module):
        """Token mixing (an MLP over the sequence, the features a batch dim) then channel mixing,
        each pre-norm and residual; ``(carry, xs) -> (carry, None)`` for ``nn.scan``."""

        @nn.compact
        def __call__(self, x, _):
            h = nn.LayerNorm(name="ln_tokens")(x).swapaxes(1, 2)  # (batch, width, seq)
            h = nn.Dense(seq, name="tokens_out")(nn.gelu(nn.Dense(2 * seq, name="tokens_in")(h)))
            x = x + h.swapaxes(1, 2)
            h = nn.LayerNorm(name="ln_channels")(x)
            return x + nn.Dense(width, name="channels_out")(nn.gelu(nn.Dense(2 * width, name="channels_in")(h))), None

    class Mixer(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(V, width, name="embed")(tokens)
            stack = nn.scan(nn.remat(MixerBlock), variable_axes={"params": 0}, split_rngs={"params": True},
                            length=layers)
            x, _ = stack(name="blocks")(x, None)
            return nn.Dense(C, name="head")(nn.LayerNorm(name="ln_f")(x).mean(axis=1))

    model = Mixer()

    def abstract_params():
        return jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((size["batch"], seq), jnp.int32)))["params"]

    return _token_workload("linen_mixer_scan", size, lambda p, b: _xent(model.apply({"params": p}, b["tokens"]), b),
                           abstract_params)


def _nnx_model(size, remat=True):
    from flax import nnx

    width, layers = size["width"], size["layers"]

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.ln1 = nnx.LayerNorm(width, rngs=rngs)
            self.qkv = nnx.Linear(width, 3 * width, rngs=rngs)
            self.out = nnx.Linear(width, width, rngs=rngs)
            self.ln2 = nnx.LayerNorm(width, rngs=rngs)
            self.up = nnx.Linear(width, 4 * width, rngs=rngs)
            self.down = nnx.Linear(4 * width, width, rngs=rngs)

        def __call__(self, x):
            b, t, _ = x.shape
            q, k, v = jnp.split(self.qkv(self.ln1(x)).reshape(b, t, 3 * HEADS, width // HEADS), 3, axis=2)
            mask = nnx.make_causal_mask(jnp.ones((b, t)))
            x = x + self.out(nnx.dot_product_attention(q, k, v, mask=mask).reshape(b, t, width))
            return x + self.down(nnx.gelu(self.up(self.ln2(x))))

    class ScannedLM(nnx.Module):
        """``nnx.Embed``, ``layers`` blocks made by ``nnx.vmap`` over split rngs and run by
        ``nnx.scan`` of an ``nnx.remat``-ed block call, mean-pooled into a head."""

        def __init__(self, rngs):
            self.embed = nnx.Embed(V, width, rngs=rngs)

            @nnx.split_rngs(splits=layers)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def create_block(rngs):
                return Block(rngs)

            self.blocks = create_block(rngs)
            self.head = nnx.Linear(width, C, rngs=rngs)

        def __call__(self, tokens):
            def call(x, block):
                return block(x)

            forward = nnx.scan(nnx.remat(call) if remat else call, in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)

            return self.head(forward(self.embed(tokens), self.blocks).mean(axis=1))

    return ScannedLM


def _nnx_scan(name, size, remat=True):
    from flax import nnx

    graphdef, abstract_state = nnx.split(nnx.eval_shape(lambda: _nnx_model(size, remat)(nnx.Rngs(0))))

    def loss_fn(params, batch):
        state = jax.tree.map(lambda x: x, abstract_state)
        nnx.replace_by_pure_dict(state, params)
        return _xent(nnx.merge(graphdef, state)(batch["tokens"]), batch)

    return _token_workload(name, size, loss_fn, lambda: nnx.to_pure_dict(abstract_state))


def _eqx_scan(name, size):
    import equinox as eqx

    seq, width, layers = size["seq"], size["width"], size["layers"]

    class Block(eqx.Module):
        """A pre-norm causal attention block and a GELU MLP over one example's tokens."""

        ln1: eqx.nn.LayerNorm
        attn: eqx.nn.MultiheadAttention
        ln2: eqx.nn.LayerNorm
        mlp: eqx.nn.MLP

        def __init__(self, key):
            k_attn, k_mlp = jax.random.split(key)
            self.ln1 = eqx.nn.LayerNorm(width)
            self.attn = eqx.nn.MultiheadAttention(HEADS, width, key=k_attn)
            self.ln2 = eqx.nn.LayerNorm(width)
            self.mlp = eqx.nn.MLP(width, width, 4 * width, depth=1, activation=jax.nn.gelu, key=k_mlp)

        def __call__(self, x):  # (seq, width)
            h = jax.vmap(self.ln1)(x)
            x = x + self.attn(h, h, h, mask=jnp.tril(jnp.ones((seq, seq), bool)))
            return x + jax.vmap(self.mlp)(jax.vmap(self.ln2)(x))

    class ScannedLM(eqx.Module):
        """``eqx.nn.Embedding``, ``layers`` blocks stacked by ``eqx.filter_vmap`` and run by
        ``lax.scan`` over their arrays, mean-pooled into a linear head."""

        embed: eqx.nn.Embedding
        blocks: Block
        head: eqx.nn.Linear

        def __init__(self, key):
            k_embed, k_blocks, k_head = jax.random.split(key, 3)
            self.embed = eqx.nn.Embedding(V, width, key=k_embed)
            self.blocks = eqx.filter_vmap(Block)(jax.random.split(k_blocks, layers))
            self.head = eqx.nn.Linear(width, C, key=k_head)

        def __call__(self, tokens):
            arrays, static = eqx.partition(self.blocks, eqx.is_array)

            def layer(x, block_arrays):
                return eqx.combine(block_arrays, static)(x), None

            x, _ = jax.lax.scan(layer, jax.vmap(self.embed)(tokens), arrays)
            return self.head(x.mean(axis=0))

    model = eqx.filter_eval_shape(ScannedLM, jax.random.key(0))
    params, static = eqx.partition(
        model, lambda x: isinstance(x, jax.ShapeDtypeStruct) and jnp.issubdtype(x.dtype, jnp.inexact))

    def loss_fn(params, batch):
        return _xent(jax.vmap(eqx.combine(params, static))(batch["tokens"]), batch)

    return _token_workload(name, size, loss_fn, lambda: params)


def _hk_stack(size):
    import haiku as hk

    width, layers = size["width"], size["layers"]

    def block(x):
        """Pre-norm causal ``hk.MultiHeadAttention`` and a SwiGLU MLP, both residual."""
        t = x.shape[1]
        h = hk.RMSNorm(axis=-1, name="rms1")(x)
        x = x + hk.MultiHeadAttention(HEADS, width // HEADS, w_init=hk.initializers.VarianceScaling(1.0),
                                      model_size=width, name="attn")(h, h, h, mask=jnp.tril(jnp.ones((1, 1, t, t), bool)))
        h = hk.RMSNorm(axis=-1, name="rms2")(x)
        gated = jax.nn.silu(hk.Linear(2 * width, name="gate")(h)) * hk.Linear(2 * width, name="up")(h)
        return x + hk.Linear(width, name="down")(gated)

    def forward(tokens):
        x = hk.Embed(V, width, name="embed")(tokens)
        x = hk.layer_stack(layers, name="blocks")(block)(x)
        return hk.Linear(C, name="head")(hk.RMSNorm(axis=-1, name="rms_f")(x).mean(axis=1))

    return forward


def linen_mixer_scan():
    """The ``linen_mixer_scan`` probe (an MLP-mixer block under nn.remat then nn.scan, 3 layers): ``fidelity.py --workload benchmarks/heldout_scanned.py:linen_mixer_scan``."""
    return _linen_mixer(SMALL)


def nnx_scan():
    """The ``nnx_scan`` probe (attention blocks made by nnx.vmap, run by nnx.scan of nnx.remat, 3 layers): ``fidelity.py --workload benchmarks/heldout_scanned.py:nnx_scan``."""
    return _nnx_scan("nnx_scan", SMALL)


def nnx_scan_long():
    """``nnx_scan`` without its ``nnx.remat`` on tokens (16, 128), width 16, 4 layers (activations outweigh parameters): ``remat.py --workload benchmarks/heldout_scanned.py:nnx_scan_long``."""
    return _nnx_scan("nnx_scan_long", LONG, remat=False)


def eqx_scan():
    """The ``eqx_scan`` probe (eqx.filter_vmap-stacked attention blocks run by lax.scan with eqx.combine, 3 layers): ``fidelity.py --workload benchmarks/heldout_scanned.py:eqx_scan``."""
    return _eqx_scan("eqx_scan", SMALL)


def eqx_scan_long():
    """``eqx_scan`` on tokens (16, 128), width 16, 4 layers (activations outweigh parameters): ``remat.py --workload benchmarks/heldout_scanned.py:eqx_scan_long``."""
    return _eqx_scan("eqx_scan_long", LONG)


def hk_layer_stack():
    """The ``hk_layer_stack`` probe (a haiku attention + SwiGLU block under hk.layer_stack, 3 layers): ``fidelity.py --workload benchmarks/heldout_scanned.py:hk_layer_stack``."""
    import haiku as hk

    model = hk.transform(_hk_stack(SMALL))
    shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((SMALL["batch"], SMALL["seq"]), jnp.int32))
    return _token_workload("hk_layer_stack", SMALL, lambda p, b: _xent(model.apply(p, None, b["tokens"]), b),
                           lambda: shapes)


def nnx_scan_long_remat():
    """``nnx_scan_long`` with its ``nnx.remat`` (the user's full recomputation of each block): ``fidelity.py --workload benchmarks/heldout_scanned.py:nnx_scan_long_remat``."""
    return _nnx_scan("nnx_scan_long_remat", LONG)
