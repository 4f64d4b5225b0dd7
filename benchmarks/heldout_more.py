"""Still more held-out probe workloads for ``benchmarks/fidelity.py --workload``, from model code this
project had not probed: Hugging Face transformers' Flax ``hf_bloom`` (``FlaxBloomForCausalLM``:
ALiBi attention biases, a LayerNorm on the embeddings, fused query/key/value), ``hf_gptj``
(``FlaxGPTJForCausalLM``: rotary embeddings on part of each head, attention and MLP in parallel
off one LayerNorm), ``hf_whisper`` (``FlaxWhisperForConditionalGeneration``: audio, two 1-D
convolutions (the second strided) over log-mel frames, sinusoidal encoder positions, a decoder
with cross-attention), ``hf_wav2vec2`` (``FlaxWav2Vec2ForCTC``: a strided 1-D convolution stack
over raw samples, a grouped convolution as relative positions, optax's CTC loss, itself a scan),
``hf_regnet`` (``FlaxRegNetForImageClassification``: grouped 3x3 convolutions, squeeze-and-excite,
BatchNorm on batch statistics), ``hf_albert`` (``FlaxAlbertForMaskedLM``: factorised embeddings,
one layer's parameters shared by every layer), ``hf_clip`` (``FlaxCLIPModel``: a text and a vision
tower, a contrastive loss over the batch's image/text similarity matrix). Tiny configs: hidden
32, 2 layers, 4 heads, batch 8; AdamW via the zoo's train step.

    KERAS_BACKEND=jax PYTHONPATH=$PWD:/work/probe_site python benchmarks/fidelity.py --episodes 16 \\
        --workload benchmarks/heldout_more.py:hf_bloom

Plus ``nnx_ensemble``: 4 members made and applied by ``nnx.vmap`` (parameters stacked on a
leading axis), each a grouped ``nnx.Conv``, ``nnx.BatchNorm`` on batch statistics and an
``nnx.MultiHeadAttention`` under a padding mask.

Every primitive has a factor rule; every plan compiles and runs. Measured on jax 0.10.2 / flax
0.12.8 / transformers 4.57.6 / keras-hub 0.32.0, one workload per run, mesh 2x4, 8 plans each,
under a heavy shared load (figures estimated / XLA):

- hf_bloom, hf_gptj, hf_whisper: 0 / 0 / 0 outside, jit parity 0 of 3, dominated 0 of 3 (hf_whisper
  default dot FLOPs 1.05 at the edge, 5.51e6 / 5.26e6).
- hf_wav2vec2: 0 / 0 / 0 outside, jit parity 0 of 3; the default dominated by manual_fsdp
  (XLA's 307.8 KiB sent, 658.5 KiB memory against 270.2 KiB, 427.3 KiB: unchanged by the fix).
  Was dot FLOPs outside on 6 of 8 (default 1.28, fsdp 1.33, fsdp_tp 1.17, manual_dp 1.39,
  manual_megatron_dp 1.07, manual_fsdp 1.39): the positional conv's kernel gradient
  (``batch_group_count`` 4 over 32 channels, 8 per group) was replicated by its factor rule, run
  whole in XLA:CPU's dense expansion where XLA splits the summed examples or the groups. Its rule
  now splits the groups (the channels and output features within a group blocked); every program
  automap compiles constrains such a conv to that layout (:mod:`automap.grouped_conv_guard`):
  with the rule alone XLA's own propagation split hf_regnet's kernel gradient 8 ways over 2
  groups in the default plan's inputs-only program and XLA:CPU aborted the process
  (``convolution_handler.cc:984``; ``python benchmarks/grouped_conv_abort.py``).
- nnx_ensemble: megatron_dp bytes sent 0.79 (182.4 / 231.9 KiB: XLA gathers 5x 162.0 KiB over
  'model' at the convs and a dot, the estimate 4x 114.0 KiB); manual_dp memory 1.43 -> 0.98 and
  manual_fsdp 1.44 -> 0.81 (a batch-grouped conv XLA:CPU rewrites over a base-dilated dim is not
  expanded densely, ``cost/xla_cpu_convs.expanded_densely``). Default plan with the grouped
  kernel-gradient rule: 1.00 / 0.91 / 1.00 (was 1.33 / 1.15 / 2.87).
- hf_regnet (grouped 3x3 convs: 2 and 4 groups): 0 / 0 / 0 outside, jit parity 1 of 3
  (manual_fsdp 1.10x ``jax.jit``'s bytes sent: the guard keeps the kernel gradients' results in
  the groups' layout, all-reduced then sliced, where ``jax.jit`` reduce-scatters them), dominated
  0 of 3. Was outside on 5 of 8 with the conv replicated (bytes / memory / FLOPs: fsdp 0.93 /
  1.14 / 1.13, fsdp_tp 0.99 / 1.15 / 1.24, manual_dp 1.17 / 1.10 / 1.38, manual_megatron_dp FLOPs
  1.14, manual_fsdp 1.38 / 1.03 / 1.38); default, data_parallel, megatron_dp memory 1.11.
- hf_albert, hf_clip: 0 / 0 / 0 outside, parity 0 of 3, dominated 0 of 3 (memory 0.94-1.03 and
  0.99-1.20, bytes sent 0.97-1.01 and 0.98-1.05).
"""
import importlib.util
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax


def _load(name):
    """The benchmark module ``name`` beside this file (the benchmarks take their folder off ``sys.path``)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py"))
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


_hf = _load("heldout_hf")
B, H, T, V, HEADS, LAYERS = _hf.B, _hf.H, _hf.T, _hf.V, _hf.HEADS, _hf.LAYERS
_hf_workload, _positions, _causal_tokens = _hf._hf_workload, _hf._positions, _hf._causal_tokens
_next_token_loss, _seq2seq_tokens, _masked_tokens = _hf._next_token_loss, _hf._seq2seq_tokens, _hf._masked_tokens
IMAGE, CHANNELS, LABELS = 16, 3, 10
MELS, FRAMES = 8, 32  # hf_whisper: 8 log-mel bins, 32 frames (16 after the strided convolution)
SAMPLES, CTC_LABELS = 400, 8  # hf_wav2vec2: 400 raw samples; 8 CTC labels per example


def hf_bloom():
    """The ``hf_bloom`` probe (FlaxBloomForCausalLM: ALiBi, embedding LayerNorm): ``fidelity.py --workload benchmarks/heldout_more.py:hf_bloom``."""
    from transformers import BloomConfig, FlaxBloomForCausalLM

    config = BloomConfig(vocab_size=V, hidden_size=H, n_layer=LAYERS, n_head=HEADS)
    module = FlaxBloomForCausalLM(config, _do_init=False).module

    def loss_fn(params, batch):
        logits = module.apply({"params": params}, batch["input_ids"], batch["attention_mask"],
                              deterministic=True).logits
        return _next_token_loss(logits, batch["input_ids"])

    return _hf_workload("hf_bloom", module, _causal_tokens, lambda b: (b["input_ids"], b["attention_mask"]),
                        loss_fn)


def hf_gptj():
    """The ``hf_gptj`` probe (FlaxGPTJForCausalLM: partial rotary, parallel attention and MLP): ``fidelity.py --workload benchmarks/heldout_more.py:hf_gptj``."""
    from transformers import FlaxGPTJForCausalLM, GPTJConfig

    config = GPTJConfig(vocab_size=V, n_embd=H, n_layer=LAYERS, n_head=HEADS, rotary_dim=H // HEADS // 2,
                        n_inner=2 * H, n_positions=T)
    return _hf._causal_lm("hf_gptj", FlaxGPTJForCausalLM(config, _do_init=False).module)


def _audio_tokens(seed):
    """Log-mel features (B, MELS, FRAMES) and a target sequence of T tokens, shifted right for the decoder."""
    rng = np.random.default_rng(seed)
    tokens = _seq2seq_tokens(seed)
    return {"input_features": rng.normal(size=(B, MELS, FRAMES)).astype(np.float32),
            "decoder_input_ids": tokens["decoder_input_ids"], "labels": tokens["labels"]}


def hf_whisper():
    """The ``hf_whisper`` probe (FlaxWhisperForConditionalGeneration: conv1d front end, encoder-decoder): ``fidelity.py --workload benchmarks/heldout_more.py:hf_whisper``."""
    from transformers import FlaxWhisperForConditionalGeneration, WhisperConfig

    config = WhisperConfig(vocab_size=V, num_mel_bins=MELS, d_model=H, encoder_layers=LAYERS,
                           decoder_layers=LAYERS, encoder_attention_heads=HEADS, decoder_attention_heads=HEADS,
                           encoder_ffn_dim=2 * H, decoder_ffn_dim=2 * H, max_source_positions=FRAMES // 2,
                           max_target_positions=T, pad_token_id=0, bos_token_id=0, eos_token_id=1,
                           decoder_start_token_id=0)
    module = FlaxWhisperForConditionalGeneration(config, _do_init=False).module

    def args(batch):
        ids = batch["decoder_input_ids"]
        return batch["input_features"], ids, jnp.ones_like(ids), _positions()

    def loss_fn(params, batch):
        logits = module.apply({"params": params}, *args(batch), deterministic=True).logits
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()

    return _hf_workload("hf_whisper", module, _audio_tokens, args, loss_fn)


def _speech(seed):
    """Raw samples (B, SAMPLES) and CTC_LABELS labels each (1..V-1; 0 is the CTC blank)."""
    rng = np.random.default_rng(seed)
    return {"input_values": rng.normal(size=(B, SAMPLES)).astype(np.float32),
            "labels": rng.integers(1, V, (B, CTC_LABELS), dtype=np.int32)}


def hf_wav2vec2():
    """The ``hf_wav2vec2`` probe (FlaxWav2Vec2ForCTC: conv feature encoder, grouped positional conv, CTC loss): ``fidelity.py --workload benchmarks/heldout_more.py:hf_wav2vec2``."""
    from transformers import FlaxWav2Vec2ForCTC, Wav2Vec2Config

    config = Wav2Vec2Config(vocab_size=V, hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                            intermediate_size=2 * H, conv_dim=(H, H, H), conv_stride=(5, 2, 2),
                            conv_kernel=(10, 3, 3), num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=4,
                            feat_extract_norm="layer", do_stable_layer_norm=True, pad_token_id=0)
    module = FlaxWav2Vec2ForCTC(config, _do_init=False).module

    def loss_fn(params, batch):
        logits = module.apply({"params": params}, batch["input_values"], deterministic=True, return_dict=True).logits
        frames = jnp.zeros(logits.shape[:2], logits.dtype)
        labels = batch["labels"]
        return optax.ctc_loss(logits, frames, labels, jnp.zeros(labels.shape, logits.dtype)).mean()

    return _hf_workload("hf_wav2vec2", module, _speech, lambda b: (b["input_values"],), loss_fn)


def _images(seed):
    """Images (B, 16, 16, 3), channels last, and a label each."""
    rng = np.random.default_rng(seed)
    return {"pixel_values": rng.normal(size=(B, IMAGE, IMAGE, CHANNELS)).astype(np.float32),
            "labels": rng.integers(0, LABELS, (B,), dtype=np.int32)}


def hf_regnet():
    """The ``hf_regnet`` probe (FlaxRegNetForImageClassification: grouped convs, squeeze-excite, BatchNorm in training mode): ``fidelity.py --workload benchmarks/heldout_more.py:hf_regnet``."""
    from transformers import FlaxRegNetForImageClassification, RegNetConfig

    config = RegNetConfig(num_channels=CHANNELS, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                          groups_width=8, layer_type="y", num_labels=LABELS)
    module = FlaxRegNetForImageClassification(config, _do_init=False).module
    # BatchNorm's running statistics are an input it updates (mutable), the update dropped. The
    # embedder's and the shortcuts' BatchNorms read the batch statistics; transformers 4.57.6's Y-layer
    # calls its inner conv layers without ``deterministic``, so those read the running statistics
    # (mean 0, variance 1 here: constants).
    shapes = jax.eval_shape(lambda: module.init(jax.random.key(0), jnp.zeros((B, IMAGE, IMAGE, CHANNELS))))
    stats = jax.tree_util.tree_map_with_path(
        lambda path, s: (jnp.ones if path[-1].key == "var" else jnp.zeros)(s.shape, s.dtype), shapes["batch_stats"])

    def loss_fn(params, batch):
        out, _ = module.apply({"params": params, "batch_stats": stats}, batch["pixel_values"],
                              deterministic=False, mutable=["batch_stats"])
        return optax.softmax_cross_entropy_with_integer_labels(out.logits, batch["labels"]).mean()

    return _hf_workload("hf_regnet", module, _images, lambda b: (b["pixel_values"],), loss_fn)


def hf_albert():
    """The ``hf_albert`` probe (FlaxAlbertForMaskedLM: factorised embeddings, shared layers): ``fidelity.py --workload benchmarks/heldout_more.py:hf_albert``."""
    from transformers import AlbertConfig, FlaxAlbertForMaskedLM

    config = AlbertConfig(vocab_size=V, embedding_size=16, hidden_size=H, num_hidden_layers=LAYERS,
                          num_attention_heads=HEADS, intermediate_size=2 * H, max_position_embeddings=T,
                          hidden_act="gelu_new")
    module = FlaxAlbertForMaskedLM(config, _do_init=False).module

    def args(batch):
        return batch["input_ids"], batch["attention_mask"], batch["token_type_ids"], _positions()

    def loss_fn(params, batch):
        logits = module.apply({"params": params}, *args(batch), deterministic=True).logits
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
        return (losses * batch["weights"]).sum() / jnp.maximum(batch["weights"].sum(), 1.0)

    return _hf_workload("hf_albert", module, _masked_tokens, args, loss_fn)


def hf_clip():
    """The ``hf_clip`` probe (FlaxCLIPModel: text and vision towers, contrastive loss): ``fidelity.py --workload benchmarks/heldout_more.py:hf_clip``."""
    from transformers import CLIPConfig, FlaxCLIPModel

    text = dict(vocab_size=V, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS, max_position_embeddings=T, eos_token_id=V - 1)
    vision = dict(hidden_size=H, intermediate_size=2 * H, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  image_size=IMAGE, patch_size=4, num_channels=CHANNELS)
    config = CLIPConfig(text_config=text, vision_config=vision, projection_dim=H)
    module = FlaxCLIPModel(config, _do_init=False).module

    def pairs(seed):
        images = _images(seed)["pixel_values"]
        tokens = _causal_tokens(seed)
        return {"input_ids": tokens["input_ids"], "attention_mask": tokens["attention_mask"],
                "pixel_values": images}

    def args(batch):
        return batch["input_ids"], batch["pixel_values"], batch["attention_mask"], _positions()

    def loss_fn(params, batch):
        logits = module.apply({"params": params}, *args(batch), deterministic=True).logits_per_text
        labels = jnp.arange(B)
        return (optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
                + optax.softmax_cross_entropy_with_integer_labels(logits.T, labels).mean()) / 2

    return _hf_workload("hf_clip", module, pairs, args, loss_fn)


ENSEMBLE = 4  # nnx_ensemble: members, their parameters stacked on a leading axis


def _nnx_ensemble_model():
    from flax import nnx

    class Member(nnx.Module):
        """``nnx.Embed``, a grouped ``nnx.Conv`` over the sequence (4 groups), ``nnx.BatchNorm`` on the
        batch's statistics, an ``nnx.MultiHeadAttention`` (``decode=False``, a padding-style mask from
        ``nnx.make_attention_mask``), mean-pooled into a linear head."""

        def __init__(self, rngs):
            self.embed = nnx.Embed(V, H, rngs=rngs)
            self.conv = nnx.Conv(H, H, (3,), feature_group_count=4, rngs=rngs)
            self.bn = nnx.BatchNorm(H, use_running_average=False, rngs=rngs)
            self.attn = nnx.MultiHeadAttention(HEADS, H, decode=False, rngs=rngs)
            self.head = nnx.Linear(H, LABELS, rngs=rngs)

        def __call__(self, tokens):
            x = self.embed(tokens)
            x = x + nnx.relu(self.bn(self.conv(x)))
            mask = nnx.make_attention_mask(tokens > 0, tokens > 0)
            x = x + self.attn(x, mask=mask)
            return self.head(x.mean(axis=1))

    class Ensemble(nnx.Module):
        """``ENSEMBLE`` members made and applied by ``nnx.vmap`` (the same tokens to each), logits averaged."""

        def __init__(self, rngs):
            @nnx.split_rngs(splits=ENSEMBLE)
            @nnx.vmap(in_axes=0, out_axes=0)
            def create(rngs):
                return Member(rngs)

            self.members = create(rngs)

        def __call__(self, tokens):
            @nnx.vmap(in_axes=(0, None), out_axes=0)
            def forward(member, tokens):
                return member(tokens)

            return forward(self.members, tokens).mean(axis=0)

    return Ensemble


def nnx_ensemble():
    """The ``nnx_ensemble`` probe (nnx.vmap'd members: grouped Conv, BatchNorm, MultiHeadAttention with a mask): ``fidelity.py --workload benchmarks/heldout_more.py:nnx_ensemble``."""
    from flax import nnx

    from automap.zoo.train import make_workload

    model = nnx.eval_shape(lambda: _nnx_ensemble_model()(nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(params_dict, batch):
        state = jax.tree.map(lambda x: x, params)
        nnx.replace_by_pure_dict(state, params_dict)
        # BatchNorm's running statistics (ones; training mode reads the batch's statistics instead).
        stats = jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), rest)
        logits = nnx.merge(graphdef, state, stats)(batch["tokens"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()

    def tokens(seed):
        rng = np.random.default_rng(seed)
        return {"tokens": rng.integers(0, V, (B, T)).astype(np.int32),
                "labels": rng.integers(0, LABELS, (B,)).astype(np.int32)}

    return make_workload("nnx_ensemble", None, loss_fn=loss_fn, abstract_params=lambda: nnx.to_pure_dict(params),
                         fill_param=_hf._fill, abstract_batch=_hf._spec(tokens), make_batch=tokens,
                         learning_rate=1e-3)
