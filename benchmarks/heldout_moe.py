"""A held-out Mixture-of-Experts probe for ``benchmarks/fidelity.py --workload``, from a package:
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

Package MoE layers tried for issue 21's GShard-style top-2 (stacked expert weights), none imports
on jax 0.10.2 / Python 3.11: maxtext 0.2.5 (Python >= 3.12; its ``moe.py`` imports tokamax,
whose newest release uses 3.12 syntax, and with tokamax 0.0.12 its attention imports
``jax.experimental.xla_metadata.must_fuse_call``, absent from jax 0.10.2), praxis 1.4.0
(``from jax.lib import xla_client``, gone from jax 0.10).
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax

from automap.zoo.train import make_workload

B, T, V, H, HEADS, LAYERS, FF, EXPERTS = 8, 16, 64, 32, 4, 2, 64, 4


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
