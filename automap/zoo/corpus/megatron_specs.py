"""The hand-written Megatron specs of the corpus models: parameter path (under ``params/``, as
automap writes input paths) -> ``PartitionSpec`` on the ``model`` axis. Column-parallel
projections split their output features (heads), row-parallel ones their input features, the
embedding and head the vocabulary; parameters not listed stay replicated. `tactics.megatron`
must find these (tests/corpus/test_corpus.py); benchmarks/fidelity.py uses them as the expert plan.

>>> MEGATRON["llama_gqa"]["layers/0/w_down"]
P('model', None)
"""
from __future__ import annotations

from jax.sharding import PartitionSpec as P

M = "model"
COL3, ROW3 = P(None, M, None), P(M, None, None)  # (D, heads, Dh) column, (heads, Dh, D) row
FLAX_ATTN = {"query/kernel": COL3, "key/kernel": COL3, "value/kernel": COL3, "out/kernel": ROW3}
_MOE = {"w_in": P(None, None, M), "w_out": P(None, M, None), "embed": P(M, None), "head": P(None, M)}

MEGATRON: dict[str, dict[str, P]] = {
    "nnx_transformer": {
        **{f"blocks/0/attn/{k}": s for k, s in FLAX_ATTN.items()},
        "blocks/0/up/kernel": P(None, M), "blocks/0/down/kernel": P(M, None),
        "embed/embedding": P(M, None), "head/kernel": P(None, M),
    },
    "linen_resnet": {"head/kernel": P(None, M)},
    "eqx_transformer": {  # equinox's Linear weight is (out, in)
        **{f"blocks/0/attn/{k}_proj/weight": P(M, None) for k in ("query", "key", "value")},
        "blocks/0/attn/output_proj/weight": P(None, M),
        "blocks/0/up/weight": P(M, None), "blocks/0/down/weight": P(None, M),
        "embed/weight": P(M, None), "head/weight": P(M, None),
    },
    "llama_gqa": {
        "layers/0/wq": COL3, "layers/0/wk": COL3, "layers/0/wv": COL3, "layers/0/wo": ROW3,
        "layers/0/w_gate": P(None, M), "layers/0/w_up": P(None, M), "layers/0/w_down": P(M, None),
        "embed": P(M, None), "lm_head": P(None, M),
    },
    "moe_ragged": dict(_MOE),
    "moe_einsum": dict(_MOE),
    "linen_vit": {
        **{f"block_0/attn/{k}": s for k, s in FLAX_ATTN.items()},
        "block_0/mlp_in/kernel": P(None, M), "block_0/mlp_out/kernel": P(M, None), "head/kernel": P(None, M),
    },
}
