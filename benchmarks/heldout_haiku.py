"""Held-out probe workloads for ``benchmarks/fidelity.py --workload``, built from dm-haiku's layer
library through ``hk.transform``, with layers that neither the corpus, the zoo nor the other
held-out probes use. ``hk_transformer``: ``hk.Embed``, ``hk.LayerNorm``, ``hk.MultiHeadAttention``
(causal) and ``hk.nets.MLP``; ``hk_resnet``: a small ``hk.nets.ResNet`` (v1 basic blocks, its
``hk.BatchNorm`` in training mode: batch statistics, the moving averages a state through
``hk.transform_with_state`` whose update the step drops); ``hk_lstm``: ``hk.LSTM`` and
``hk.VanillaRNN`` stacked by ``hk.deep_rnn_with_skip_connections`` under ``hk.dynamic_unroll`` (a
``lax.scan``); ``hk_conv_misc``: ``hk.Conv2D``, ``hk.GroupNorm``, a strided ``hk.DepthwiseConv2D``,
``hk.avg_pool``, then the map's pixels as a sequence through ``hk.Conv1D``, ``hk.RMSNorm``,
``hk.max_pool`` and ``hk.dropout`` drawn from a key. AdamW via the zoo's train step; batch 8,
tokens (8, 16) of vocab 64 or images (8, 8, 8, 3) (NHWC, haiku's layout), 8 classes. dm-haiku is
not a project dependency: ``pip install dm-haiku`` to run these.

    python benchmarks/fidelity.py --workload benchmarks/heldout_haiku.py:hk_transformer \
        --workload benchmarks/heldout_haiku.py:hk_resnet \
        --workload benchmarks/heldout_haiku.py:hk_lstm \
        --workload benchmarks/heldout_haiku.py:hk_conv_misc --episodes 16

Measured on jax 0.10.2 and dm-haiku 0.0.17, mesh 2x4 (32 plans), one workload per run: no plan
fails and no primitive lacks a rule; bytes sent outside 10% in 0, memory outside 25% in 0, dot
FLOPs outside 5% in 0; jit parity 0 of 12, the default dominated in 0 of 12 (before the two fixes
below: bytes 4 outside, FLOPs 8). Once outside:

- hk_resnet, every plan, dot FLOPs 1.32 (1.22 fsdp_tp), now 1.00: the ResNet's last two stages
  run 3x3 convs over 2x2 and 1x1 maps. XLA's conv operand swap makes the input the window when
  the kernel's window is larger, so the taps that read only padding are not computed (4/9 and
  1/9 of the count); the estimate counted the whole kernel. XLA:CPU's FLOPs now follow the swap
  (:func:`automap.rules.conv_windows.swapped_window_ratio`), which also gives the transposed
  conv's kernel gradient its count (it is the same swap).
- hk_conv_misc data_parallel, megatron_dp and manual_megatron_dp bytes 1.25, fsdp_tp 1.12, now
  1.00: the input gradient of ``hk.DepthwiseConv2D(2, 3, stride=2)`` is a grouped conv with two
  input features per group, which XLA does not partition: it gathers the output's gradient over
  'data' and runs the conv whole. The estimate priced that gather as a dot's detour over the idle
  'model' axis (a permute and a gather over 'model'); a contraction whose factors are all kept
  whole takes no detour now (:func:`automap.idle_axis_detours.idle_axis_detours`).

The default search replicates hk_resnet and hk_lstm (no bytes sent): on these small steps its
estimate puts the replicated program's time below every split plan's (hk_resnet 352 us against
660 us for data parallel, hk_lstm 844 against 1,100 us), so no manual plan dominates it (it sends
nothing) but it holds the most memory of the plans (744 KiB and 646 KiB per device).
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax

from automap.zoo.train import make_workload

B, T, V, H, C = 8, 16, 64, 32, 8
HEADS = 4
IMAGE = (8, 8, 3)  # one example's (height, width, channels), haiku's NHWC layout


def _fill(names, leaf, rng):
    return (rng.normal(size=leaf.shape) * 0.1).astype(leaf.dtype)


def _token_batch():
    return {"tokens": jax.ShapeDtypeStruct((B, T), jnp.int32), "labels": jax.ShapeDtypeStruct((B,), jnp.int32)}


def _tokens(seed):
    rng = np.random.default_rng(seed)
    return {"tokens": rng.integers(0, V, (B, T)).astype(np.int32), "labels": rng.integers(0, C, (B,)).astype(np.int32)}


def _image_batch():
    return {"image": jax.ShapeDtypeStruct((B, *IMAGE), jnp.float32), "labels": jax.ShapeDtypeStruct((B,), jnp.int32)}


def _images(seed):
    rng = np.random.default_rng(seed)
    return {"image": rng.normal(size=(B, *IMAGE)).astype(np.float32),
            "labels": rng.integers(0, C, (B,)).astype(np.int32)}


def _hk_workload(name, forward, inputs, abstract_batch, make_batch, *, stateful=False, rng=False):
    """A workload for the haiku function ``forward(x)`` (of ``batch[inputs]``) to logits: its
    parameters are ``hk.transform(forward).init``'s (by ``jax.eval_shape``); with ``stateful`` the
    model is ``hk.transform_with_state``'s and the loss starts from the initial state's shapes,
    zeros (haiku's moving averages start at zero), dropping the updated state; with ``rng`` the
    loss applies the model with a fixed key (``hk.next_rng_key`` inside draws from it)."""
    import haiku as hk

    model = hk.transform_with_state(forward) if stateful else hk.transform(forward)
    example = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), abstract_batch()[inputs])
    shapes = jax.eval_shape(model.init, jax.random.key(0), example)
    params_shape, state_shape = shapes if stateful else (shapes, None)

    def loss_fn(params, batch):
        key = jax.random.key(1) if rng else None
        if stateful:
            state = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), state_shape)
            logits, _ = model.apply(params, state, key, batch[inputs])
        else:
            logits = model.apply(params, key, batch[inputs])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()

    return make_workload(name, None, loss_fn=loss_fn, abstract_params=lambda: params_shape, fill_param=_fill,
                         abstract_batch=abstract_batch, make_batch=make_batch, learning_rate=1e-3)


def _transformer(tokens):
    """``hk.Embed`` plus a learned position table, a pre-norm causal ``hk.MultiHeadAttention``
    block and an ``hk.nets.MLP`` (GELU), ``hk.LayerNorm`` before each, mean-pooled into a head."""
    import haiku as hk

    x = hk.Embed(V, H, name="embed")(tokens)
    x = x + hk.get_parameter("positions", (T, H), init=hk.initializers.TruncatedNormal(0.02))
    mask = jnp.tril(jnp.ones((1, 1, T, T), bool))
    h = hk.LayerNorm(axis=-1, create_scale=True, create_offset=True, name="ln1")(x)
    x = x + hk.MultiHeadAttention(HEADS, H // HEADS, w_init=hk.initializers.VarianceScaling(1.0),
                                  model_size=H, name="attn")(h, h, h, mask=mask)
    h = hk.LayerNorm(axis=-1, create_scale=True, create_offset=True, name="ln2")(x)
    x = x + hk.nets.MLP([2 * H, H], activation=jax.nn.gelu, name="mlp")(h)
    return hk.Linear(C, name="head")(x.mean(axis=1))


def _resnet(image):
    """``hk.nets.ResNet`` v1 with basic (non-bottleneck) blocks, one per group, channels
    (8, 16, 16, 32), a 3x3 stem without stride; its BatchNorms normalize by batch statistics."""
    import haiku as hk

    net = hk.nets.ResNet(blocks_per_group=(1, 1, 1, 1), num_classes=C, bottleneck=False,
                         channels_per_group=(8, 16, 16, 32), use_projection=(True, True, True, True),
                         initial_conv_config={"output_channels": 8, "kernel_shape": 3, "stride": 1},
                         name="resnet")
    return net(image, is_training=True)


def _lstm(tokens):
    """``hk.Embed``, then ``hk.LSTM`` and ``hk.VanillaRNN`` with skip connections
    (``hk.deep_rnn_with_skip_connections``: each layer reads the input and the layer below) unrolled
    over the tokens by ``hk.dynamic_unroll``, the outputs mean-pooled into a head."""
    import haiku as hk

    x = hk.Embed(V, H, name="embed")(tokens)
    core = hk.deep_rnn_with_skip_connections([hk.LSTM(H, name="lstm"), hk.VanillaRNN(H, name="rnn")])
    outputs, _ = hk.dynamic_unroll(core, x, core.initial_state(B), time_major=False)
    return hk.Linear(C, name="head")(outputs.mean(axis=1))


def _conv_misc(image):
    """``hk.Conv2D``, ``hk.GroupNorm``, a strided ``hk.DepthwiseConv2D`` (two channels per input
    channel), ``hk.avg_pool``; the 4x4 map's 16 pixels as a sequence: ``hk.Conv1D``,
    ``hk.RMSNorm``, ``hk.max_pool`` over the sequence, ``hk.dropout`` (rate 0.1, a key), a head."""
    import haiku as hk

    x = hk.Conv2D(16, 3, name="conv")(image)
    x = jax.nn.relu(hk.GroupNorm(4, name="gn")(x))
    x = jax.nn.relu(hk.DepthwiseConv2D(2, 3, stride=2, name="depthwise")(x))  # (B, 4, 4, 32)
    x = hk.avg_pool(x, window_shape=(1, 3, 3, 1), strides=1, padding="SAME")
    x = x.reshape(x.shape[0], -1, x.shape[-1])  # (B, 16, 32)
    x = jax.nn.gelu(hk.Conv1D(H, 3, name="conv1d")(x))
    x = hk.RMSNorm(axis=-1, name="rms")(x)
    x = hk.max_pool(x, window_shape=(1, 2, 1), strides=(1, 2, 1), padding="VALID")  # (B, 8, 32)
    x = hk.dropout(hk.next_rng_key(), 0.1, x)
    return hk.Linear(C, name="head")(x.reshape(x.shape[0], -1))


def hk_transformer():
    """The ``hk_transformer`` probe (hk.Embed, hk.LayerNorm, causal hk.MultiHeadAttention, hk.nets.MLP over tokens): ``fidelity.py --workload benchmarks/heldout_haiku.py:hk_transformer``."""
    return _hk_workload("hk_transformer", _transformer, "tokens", _token_batch, _tokens)


def hk_resnet():
    """The ``hk_resnet`` probe (a small hk.nets.ResNet, hk.BatchNorm on batch statistics via hk.transform_with_state): ``fidelity.py --workload benchmarks/heldout_haiku.py:hk_resnet``."""
    return _hk_workload("hk_resnet", _resnet, "image", _image_batch, _images, stateful=True)


def hk_lstm():
    """The ``hk_lstm`` probe (hk.LSTM and hk.VanillaRNN by hk.deep_rnn_with_skip_connections under hk.dynamic_unroll): ``fidelity.py --workload benchmarks/heldout_haiku.py:hk_lstm``."""
    return _hk_workload("hk_lstm", _lstm, "tokens", _token_batch, _tokens)


def hk_conv_misc():
    """The ``hk_conv_misc`` probe (hk.Conv2D, GroupNorm, a strided DepthwiseConv2D, avg_pool, Conv1D, RMSNorm, max_pool, dropout from a key): ``fidelity.py --workload benchmarks/heldout_haiku.py:hk_conv_misc``."""
    return _hk_workload("hk_conv_misc", _conv_misc, "image", _image_batch, _images, rng=True)
