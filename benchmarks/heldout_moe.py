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
every plan compiles and runs; bytes sent outside 10% in 3, memory outside 25% in 0, dot FLOPs
outside 5% in 0; jit parity 0 of 3, the default dominated in 0 of 3 (default 373.6 KiB, 735.0
KiB by XLA; manual_fsdp 544.4 KiB, 595.9 KiB).

- data_parallel and manual_megatron_dp (the same plan: no Megatron specs for these names) bytes
  sent 0.73 (253.6 / 349.6 KiB), megatron_dp 0.79 (361.1 / 457.1 KiB): the top-2 pick
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
0; jit parity 0 of 3, the default dominated in 0 of 3 (default 232.2 / 251.5 KiB sent, 525.0 /
540.1 KiB memory, estimated / XLA). Issue 21's comparison (``moe_expert.py``, the 6 expert
weights and their 12 Adam moments split over 'model', XLA:CPU's measure, every loss equal to the
unsharded step's): hand EP with the batch on data 171,272 B sent, 868,644 B memory; on both axes
194,867 B, 768,740 B; the default (the arbiter keeps ``expert_parallel('model') +
megatron('data')`` over the searched answer) 257,570 B, 553,564 B: 1.50x the bytes, 0.64x the
memory of the better hand plan; not met in bytes. The hand plans run attention whole on every
'model' device (dot FLOPs 8.75e6 estimated against the default's 5.75e6), yet the cost model
prices hand EP on data (the same plan as ``data_parallel('data') + expert_parallel('model',
tokens=False)``: 171,272 B, 868,644 B) at 1229 us, faster than the searched answer's 1285 us:
the default search misses it. With ``--topology h100-8`` the default replicates (0 B sent,
3,484,004 B memory, 4.01x), and with the hand plan's memory as its budget finds hand EP on data
itself (171,272 B, 868,644 B: <= in both).

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
    os.environ.setdefault("KERAS_BACKEND", "jax")
    import keras
    from keras_hub.models import MixtralBackbone, MixtralCausalLM

    keras.utils.clear_session()  # layer names (mixtral_sparse_moe_block_1, ...) count from zero again
    backbone = MixtralBackbone(vocabulary_size=V, num_layers=LAYERS, num_query_heads=HEADS, hidden_dim=H,
                               intermediate_dim=FF, num_key_value_heads=KV_HEADS, num_experts=EXPERTS, top_k=2,
                               sliding_window=T, router_aux_loss_coef=0.02, dropout=0)
    model = MixtralCausalLM(backbone, preprocessor=None)
    variables = model.trainable_variables
    paths = [v.path for v in variables]
    assert not model.non_trainable_variables, [v.path for v in model.non_trainable_variables]

    def loss_fn(params, batch):
        tokens = batch["tokens"]
        inputs = {"token_ids": tokens, "padding_mask": jnp.ones(tokens.shape, jnp.int32)}
        logits, _, losses = model.stateless_call(_unnest(params, paths), [], inputs, training=True,
                                                 return_losses=True)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()
        return ce + sum(losses)  # the routers' load-balancing losses, 0.02 x each, as keras adds them

    def abstract_params():
        return _nest(paths, [jax.ShapeDtypeStruct(tuple(v.shape), v.dtype) for v in variables])

    return make_workload("keras_mixtral", backbone.get_config(), loss_fn=loss_fn, abstract_params=abstract_params,
                         fill_param=_fill, abstract_batch=lambda: {"tokens": jax.ShapeDtypeStruct((B, T), jnp.int32)},
                         make_batch=_tokens, learning_rate=1e-3)
