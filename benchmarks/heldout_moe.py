"""Held-out Mixture-of-Experts probes for ``benchmarks/fidelity.py --workload``, from packages.

``nano_moe``: nano-moe-jax 0.1.0's ``NanoMoE`` (linen; a top-2 router by ``jax.lax.top_k``, a
Switch-style load-balancing loss from the top-1 one-hot, 4 expert FFNs as separate ``Dense``
pairs all run on every token, stacked (E, B, T, D) and the top-2 picked by advanced indexing,
``expert_outputs[indices, batch, seq]``, weighted by the softmax of the top-2 logits). 2 layers,
hidden 32, 4 heads, d_ff 64, vocab 64, batch 8 x 16 tokens, no dropout; next-token cross-entropy
plus 0.01 x the load-balancing loss, AdamW via the zoo's train step. The experts are separate
arrays, not one stacked (E, ...) weight, so no PartitionSpec splits them over devices: issue 21's
expert-parallel comparison does not apply, the fidelity figures do. nano-moe-jax is not a project
dependency (``pip install --no-deps nano-moe-jax``).

    PYTHONPATH=$PWD:/work/probe_site python benchmarks/fidelity.py --episodes 16 \\
        --workload benchmarks/heldout_moe.py:nano_moe

Measured on jax 0.10.2 / flax 0.12.8, mesh 2x4 (8 plans): every primitive has a factor rule and
every plan compiles and runs; bytes sent outside 10% in 0, memory outside 25% in 0, dot FLOPs
outside 5% in 0; jit parity 0 of 3, the default dominated in 0 of 3 (default 343.1 / 373.6 KiB
sent, 841.0 / 735.0 KiB memory, estimated / XLA; manual_fsdp 544.4 KiB, 595.9 KiB by XLA).

- Earlier, data_parallel and manual_megatron_dp (the same plan: no Megatron specs for these
  names) bytes sent 0.73 (253.6 / 349.6 KiB), megatron_dp 0.79 (361.1 / 457.1 KiB): the top-2 pick
  ``expert_outputs[indices, iota(B), iota(T)]``, a gather whose batch and sequence indices are
  iotas, with the tokens on 'data' and 'model' idle. The estimate gathers whole over 'data' (6
  all-gathers, 37 KiB, at ``top_k`` and the gather); XLA partitions the gather and its transpose
  (a scatter-add) over data+model: 6 collective-permutes, 67 KiB, and 2 all-reduces over 'model'
  at the scatter-add, 64 KiB (its all-gathers over 'data': 2 KiB, at ``top_k``). The same in plain
  JAX (4 stacked (8, 16, 32) outputs, the top-2 picked so, ``data_parallel('data')``): bytes sent
  estimated 50.5 KiB, XLA 98.5 KiB, memory 204.5 / 136.2 KiB.

``keras_mixtral``: keras-hub 0.32.0's ``MixtralCausalLM`` on Keras 3.15.1's JAX backend
(``KERAS_BACKEND=jax``): the experts stacked, (4, 32, 64) gate and up, (4, 64, 32) down weights
per layer, every expert run on every token by ``einsum`` ("th,ehm->etm") and the top-2 kept by a
one-hot of ``top_k``'s indices times the renormalised top-2 probabilities, summed over experts;
grouped-query attention (4 query, 2 key/value heads) with rotary embeddings, RMS norms, untied
output embedding. 2 layers, hidden 32, d_ff 64, vocab 64, sliding window 16, batch 8 x 16, no
dropout; the step is ``model.stateless_call`` on the trainable variables as a nested dict (keyed
by the variables' paths), next-token cross-entropy plus the routers' 0.02 x load-balancing losses
(``return_losses=True``), AdamW via the zoo's train step. keras, keras-hub, optree, namex and h5py
are not project dependencies (``pip install --no-deps``).

    PYTHONPATH=$PWD:/work/probe_site python benchmarks/fidelity.py --episodes 16 \\
        --workload benchmarks/heldout_moe.py:keras_mixtral
    PYTHONPATH=$PWD:/work/probe_site python benchmarks/moe_expert.py \\
        --workload benchmarks/heldout_moe.py:keras_mixtral

Measured on jax 0.10.2, mesh 2x4 (8 plans): every primitive has a factor rule and every plan
compiles and runs; bytes sent outside 10% in 0, memory outside 25% in 0, dot FLOPs outside 5% in
0; jit parity 0 of 3, the default dominated in 0 of 3 (default 167.3 / 167.3 KiB sent, 794.2 /
848.0 KiB memory, estimated / XLA). Issue 21's comparison (``moe_expert.py``, the 6 expert
weights and their 12 Adam moments split over 'model', XLA:CPU's measure, every loss equal to the
unsharded step's): hand EP with the batch on data 171,272 B sent, 868,644 B memory; on both axes
194,867 B, 768,740 B; the default 171,272 B, 868,644 B: 1.000x / 1.000x, met (since the search
macro ``expert_parallel_tokens_whole``: the default is hand EP on data). Before it the arbiter kept
``expert_parallel('model') + megatron('data')``, 257,570 B, 553,564 B (1.50x the bytes). The hand plans run attention whole on every
'model' device (dot FLOPs 8.75e6 estimated against the default's 5.75e6), yet the cost model
prices hand EP on data (the same plan as ``data_parallel('data') + expert_parallel('model',
tokens=False)``: 171,272 B, 868,644 B) at 1229 us, faster than the searched answer's 1285 us:
the default search missed it. With ``--topology h100-8`` the default replicates (0 B sent,
3,484,004 B memory, 4.01x), and with the hand plan's memory as its budget finds hand EP on data
itself (171,272 B, 868,644 B: <= in both).

``keras_qwen_moe``, ``keras_qwen3_moe``, ``keras_gpt_oss``: keras-hub 0.32.0's Qwen-MoE, Qwen3-MoE
and GPT-OSS causal LMs, built as ``keras_mixtral`` (:func:`_keras_causal_lm`; 2 layers, hidden 32,
4 experts, top-2, 4 query / 2 key-value heads, vocab 64, batch 8 x 16). Each stacks its experts
and runs every expert on every token by ``einsum``, as Mixtral. Qwen-MoE adds a shared expert (a
dense gated MLP on every token, scaled by a sigmoid gate) beside the routed ones (its paths hold
``shared_expert``: measure with ``--experts /experts/``); Qwen3-MoE has query/key RMS norms and no
shared expert; GPT-OSS biases its experts ((4, 128) and (4, 32) beside the weights), takes gate
and up as strided slices (``[..., ::2]``, ``[..., 1::2]``) with clipped, scaled sigmoid gating, has
attention sinks (a learned logit per head concatenated to the scores) and no load-balancing loss
(``--experts /experts/``: its expert arrays are named ``gate_up_proj``, ``down_proj``).

    PYTHONPATH=$PWD:/work/probe_site python benchmarks/moe_expert.py \
        --workload benchmarks/heldout_moe.py:keras_qwen_moe --experts /experts/

Issue 21's comparison (``moe_expert.py``, mesh 2x4, XLA:CPU's measure, every loss equal to the
unsharded step's), default / the better hand EP plan (the batch on data in each):

- Qwen3-MoE: 146,828 B sent, 867,940 B memory, the default the same plan: 1.000x / 1.000x, met.
- GPT-OSS (24 inputs matched: weights, biases, their moments): 146,676 B, 855,556 B, the default
  the same plan: 1.000x / 1.000x, met.
- Qwen-MoE: hand EP on data 196,620 B, 1,233,596 B; on both 269,955 B, 969,276 B; the default
  the same plan as the first (``data_parallel('data') + expert_parallel('model', tokens=False)``):
  1.000x / 1.000x, met. The search's answer by estimate is ``data_parallel('model') +
  expert_parallel('data', tokens=False)`` plus one shared-expert kernel split (1.220 ms): the
  shared expert, a dense MLP on every token, runs whole on every device of the experts' axis in
  the hand plan (estimated 1.506 ms), so the cost model puts the batch on the wider axis; the
  search does not miss the hand plan (a composition of the beam, on the (bytes, memory) front, one
  of the final candidates). XLA measures the answer at 290.3 KiB sent, 1.0 MiB; the arbiter's climb
  (``automap.arbiter.final_choice``) went on for memory to ``data_parallel('data') +
  megatron('model')`` (301.2 KiB, 706.1 KiB, 1.873 ms) and kept it, 308,472 B, 723,340 B: 1.569x
  the bytes, 0.586x the memory. The climb now moves on to an expert plan of the measured front
  faster by estimate than the one kept and sending fewer bytes by XLA's measure: the hand plan.

Fidelity (``fidelity.py --episodes 16``, mesh 2x4, 8 plans): Qwen-MoE bytes sent outside 10% in
0, memory outside 25% in 0, dot FLOPs outside 5% in 0, jit parity 0 of 3, dominated 0 of 3
(default 297.1 / 301.2 KiB sent, 711.9 / 706.1 KiB memory, estimated / XLA;
measured before the climb's move to the hand plan above, not since).
GPT-OSS: bytes sent outside 10% in 1, memory outside 25% in 1, dot FLOPs outside 5% in 0, jit
parity 0 of 3, dominated 0 of 3 (default 143.2 / 143.2 KiB sent, 936.2 / 835.3 KiB memory). Out:
fsdp_tp, bytes 1.37 (438.2 / 319.6 KiB), memory 1.28 (715.5 / 557.6 KiB); every row's memory is
over XLA's (1.12 to 1.28; not diagnosed: the expert biases, the strided gate/up slices and the
sinks' concatenate are what GPT-OSS adds to Qwen3-MoE, whose rows are all within the bands).
Qwen3-MoE: bytes sent outside 10% in 0, memory outside 25% in 0, dot FLOPs outside 5% in 0, jit
parity 0 of 3, dominated 0 of 3 (default 143.4 / 143.4 KiB sent, 849.0 / 847.3 KiB memory).

Package MoE layers tried for issue 21's GShard-style top-2 (stacked expert weights) that do not
import on jax 0.10.2 / Python 3.11: maxtext 0.2.5 (Python >= 3.12; its ``moe.py`` imports tokamax,
whose newest release uses 3.12 syntax, and with tokamax 0.0.12 its attention imports
``jax.experimental.xla_metadata.must_fuse_call``, absent from jax 0.10.2), praxis 1.4.0
(``from jax.lib import xla_client``, gone from jax 0.10).
"""
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax

from automap.zoo.train import make_workload

B, T, V, H, HEADS, LAYERS, FF, EXPERTS = 8, 16, 64, 32, 4, 2, 64, 4
KV_HEADS = 2  # keras_mixtral: grouped-query attention, as Mixtral


def _fill(names, leaf, rng):
    if names[-1] == "scale":  # LayerNorm gains
        return np.ones(leaf.shape, leaf.dtype)
    return (rng.normal(size=leaf.shape) * 0.1).astype(leaf.dtype)


def _tokens(seed):
    return {"tokens": np.random.default_rng(seed).integers(0, V, (B, T), dtype=np.int32)}


def nano_moe():
    """The ``nano_moe`` probe (nano-moe-jax's NanoMoE, top-2 of 4 experts): ``fidelity.py --workload benchmarks/heldout_moe.py:nano_moe``."""
    from nano_moe import NanoMoE, NanoMoEConfig

    config = NanoMoEConfig(vocab_size=V, n_layers=LAYERS, n_heads=HEADS, d_model=H, d_ff=FF, n_experts=EXPERTS,
                           top_k=2, block_size=T, dropout_rate=0.0)
    model = NanoMoE(config)

    def loss_fn(params, batch):
        logits, aux = model.apply({"params": params}, batch["tokens"], deterministic=True)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], batch["tokens"][:, 1:]).mean()
        return ce + config.aux_loss_coeff * aux

    def abstract_params():
        return jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((B, T), jnp.int32)))["params"]

    return make_workload("nano_moe", config, loss_fn=loss_fn, abstract_params=abstract_params, fill_param=_fill,
                         abstract_batch=lambda: {"tokens": jax.ShapeDtypeStruct((B, T), jnp.int32)},
                         make_batch=_tokens, learning_rate=1e-3)


def _nest(paths, leaves):
    """A nested dict from "/"-joined keras variable paths (``a/b/kernel``) and their leaves."""
    tree = {}
    for path, leaf in zip(paths, leaves):
        *parents, name = path.split("/")
        node = tree
        for parent in parents:
            node = node.setdefault(parent, {})
        node[name] = leaf
    return tree


def _unnest(tree, paths):
    """The leaves of :func:`_nest`'s tree in ``paths`` order (keras's ``trainable_variables`` order)."""
    leaves = []
    for path in paths:
        node = tree
        for key in path.split("/"):
            node = node[key]
        leaves.append(node)
    return leaves


def keras_mixtral():
    """The ``keras_mixtral`` probe (keras-hub's Mixtral, stacked experts, top-2 of 4): ``fidelity.py --workload benchmarks/heldout_moe.py:keras_mixtral``."""
    from keras_hub.models import MixtralBackbone, MixtralCausalLM

    return _keras_causal_lm("keras_mixtral", MixtralBackbone, MixtralCausalLM, num_query_heads=HEADS,
                            intermediate_dim=FF, num_key_value_heads=KV_HEADS, sliding_window=T,
                            router_aux_loss_coef=0.02)


def keras_qwen_moe():
    """The ``keras_qwen_moe`` probe (keras-hub's Qwen-MoE, top-2 of 4 plus a gated shared expert): ``moe_expert.py --workload benchmarks/heldout_moe.py:keras_qwen_moe``."""
    from keras_hub.models import QwenMoeBackbone, QwenMoeCausalLM

    return _keras_causal_lm("keras_qwen_moe", QwenMoeBackbone, QwenMoeCausalLM, num_query_heads=HEADS,
                            num_key_value_heads=KV_HEADS, intermediate_dim=FF, moe_intermediate_dim=FF,
                            shared_expert_intermediate_dim=FF, norm_top_k_prob=True,
                            router_aux_loss_coefficient=0.02)


def keras_qwen3_moe():
    """The ``keras_qwen3_moe`` probe (keras-hub's Qwen3-MoE, top-2 of 4, query/key norms): ``moe_expert.py --workload benchmarks/heldout_moe.py:keras_qwen3_moe``."""
    from keras_hub.models import Qwen3MoeBackbone, Qwen3MoeCausalLM

    return _keras_causal_lm("keras_qwen3_moe", Qwen3MoeBackbone, Qwen3MoeCausalLM, num_query_heads=HEADS,
                            num_key_value_heads=KV_HEADS, intermediate_dim=FF, moe_intermediate_dim=FF,
                            head_dim=H // HEADS, norm_top_k_prob=True, router_aux_loss_coefficient=0.02)


def keras_gpt_oss():
    """The ``keras_gpt_oss`` probe (keras-hub's GPT-OSS, top-2 of 4, biased experts, attention sinks): ``moe_expert.py --workload benchmarks/heldout_moe.py:keras_gpt_oss``."""
    from keras_hub.models import GptOssBackbone, GptOssCausalLM

    return _keras_causal_lm("keras_gpt_oss", GptOssBackbone, GptOssCausalLM, num_query_heads=HEADS,
                            num_key_value_heads=KV_HEADS, intermediate_dim=FF, sliding_window=T,
                            head_dim=H // HEADS)


def _keras_causal_lm(name, backbone_class, causal_lm_class, **config):
    """A keras-hub causal LM (``LAYERS`` layers, hidden ``H``, ``EXPERTS`` experts, top-2, vocab ``V``, no
    dropout) as a workload: ``model.stateless_call`` on the trainable variables as a nested dict (keyed by
    their paths), next-token cross-entropy plus the routers' load-balancing losses (``return_losses=True``),
    AdamW via the zoo's train step."""
    os.environ.setdefault("KERAS_BACKEND", "jax")
    import keras

    keras.utils.clear_session()  # layer names (..._moe_block_1, ...) count from zero again
    backbone = backbone_class(vocabulary_size=V, num_layers=LAYERS, hidden_dim=H, num_experts=EXPERTS, top_k=2,
                              dropout=0, **config)
    model = causal_lm_class(backbone, preprocessor=None)
    variables = model.trainable_variables
    paths = [v.path for v in variables]
    assert not model.non_trainable_variables, [v.path for v in model.non_trainable_variables]

    def loss_fn(params, batch):
        tokens = batch["tokens"]
        inputs = {"token_ids": tokens, "padding_mask": jnp.ones(tokens.shape, jnp.int32)}
        logits, _, losses = model.stateless_call(_unnest(params, paths), [], inputs, training=True,
                                                 return_losses=True)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()
        return ce + sum(losses)  # the routers' load-balancing losses, already scaled, as keras adds them

    def abstract_params():
        return _nest(paths, [jax.ShapeDtypeStruct(tuple(v.shape), v.dtype) for v in variables])

    return make_workload(name, backbone.get_config(), loss_fn=loss_fn, abstract_params=abstract_params,
                         fill_param=_fill, abstract_batch=lambda: {"tokens": jax.ShapeDtypeStruct((B, T), jnp.int32)},
                         make_batch=_tokens, learning_rate=1e-3)
