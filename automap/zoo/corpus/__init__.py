"""A corpus of third-party model code: models built from the layers other libraries ship (flax
nnx and linen, equinox) and common open-source model shapes (a Llama-style GQA decoder, two
mixture-of-experts layers, a ViT), each a `Workload` like the rest of the zoo: tiny configs,
random init, the zoo's train step. equinox is imported only by `eqx_transformer`.

>>> from automap.zoo import corpus
>>> sorted(corpus.BUILDERS)[:3]
['eqx_transformer', 'linen_resnet', 'linen_vit']
"""

from automap.zoo.corpus.eqx_transformer import EqxTransformerConfig, eqx_transformer
from automap.zoo.corpus.linen_resnet import ResNetConfig, linen_resnet
from automap.zoo.corpus.linen_vit import ViTConfig, linen_vit
from automap.zoo.corpus.llama_gqa import LlamaConfig, llama_gqa
from automap.zoo.corpus.moe import MoEConfig, moe_einsum, moe_ragged
from automap.zoo.corpus.nnx_transformer import NNXTransformerConfig, nnx_transformer

# name -> builder (default tiny config)
BUILDERS = {
    "nnx_transformer": nnx_transformer,
    "linen_resnet": linen_resnet,
    "eqx_transformer": eqx_transformer,
    "llama_gqa": llama_gqa,
    "moe_ragged": moe_ragged,
    "moe_einsum": moe_einsum,
    "linen_vit": linen_vit,
}

__all__ = [
    "BUILDERS", "EqxTransformerConfig", "LlamaConfig", "MoEConfig", "NNXTransformerConfig", "ResNetConfig",
    "ViTConfig", "eqx_transformer", "linen_resnet", "linen_vit", "llama_gqa", "moe_einsum", "moe_ragged",
    "nnx_transformer",
]
