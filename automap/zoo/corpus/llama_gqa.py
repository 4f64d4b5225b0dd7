"""A Llama-style decoder in pure JAX: RMSNorm, rotary position embeddings written with
`jnp.stack` (the interleaved-pair form), grouped-query attention (``kv_heads < heads``: each
key/value head serves ``heads // kv_heads`` query heads) and a SwiGLU MLP; no biases.

Parameters (``L`` layers; ``H`` heads, ``K`` kv heads, ``Dh`` head dim, ``F`` hidden)::

    params/embed                        (V, D)
    params/layers/{i}/attn_norm         (D,)
    params/layers/{i}/wq                (D, H, Dh)
    params/layers/{i}/wk, wv            (D, K, Dh)
    params/layers/{i}/wo                (H, Dh, D)
    params/layers/{i}/mlp_norm          (D,)
    params/layers/{i}/w_gate, w_up      (D, F)
    params/layers/{i}/w_down            (F, D)
    params/final_norm                   (D,)
    params/lm_head                      (D, V)

>>> w = llama_gqa(LlamaConfig())
>>> w.abstract()[0]["params"]["layers"][0]["wk"].shape
(32, 4, 4)
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax

from automap.zoo.corpus.values import fill_param, lm_abstract_batch, lm_batch
from automap.zoo.train import make_workload
from automap.zoo.workload import Workload


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Sizes of the decoder (``heads`` a multiple of ``kv_heads``, ``head_dim`` even)."""

    vocab: int = 64
    seq: int = 8
    d_model: int = 32
    heads: int = 8
    kv_heads: int = 4
    head_dim: int = 4
    hidden: int = 64
    layers: int = 1
    batch: int = 4
    learning_rate: float = 1e-3


def rms_norm(x, scale, eps=1e-6):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def rotary(x, positions, base=10000.0):
    """Rotate each interleaved pair ``(x[2i], x[2i+1])`` of ``x`` [batch, seq, heads, head_dim]."""
    half = x.shape[-1] // 2
    freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions[:, None] * freq[None, :]  # (seq, half)
    cos, sin = jnp.cos(angle)[None, :, None, :], jnp.sin(angle)[None, :, None, :]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).reshape(x.shape)


def attention(p, x, cfg: LlamaConfig):
    b, s, _ = x.shape
    positions = jnp.arange(s, dtype=jnp.float32)
    q = rotary(jnp.einsum("bsd,dhk->bshk", x, p["wq"]), positions)
    k = rotary(jnp.einsum("bsd,dhk->bshk", x, p["wk"]), positions)
    v = jnp.einsum("bsd,dhk->bshk", x, p["wv"])
    q = q.reshape(b, s, cfg.kv_heads, cfg.heads // cfg.kv_heads, cfg.head_dim)  # query groups
    logits = jnp.einsum("bqkgd,bskd->bkgqs", q, k) / jnp.sqrt(jnp.float32(cfg.head_dim))
    mask = jnp.tril(jnp.ones((s, s), bool))
    probs = jax.nn.softmax(jnp.where(mask, logits, jnp.finfo(logits.dtype).min), axis=-1)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v).reshape(b, s, cfg.heads, cfg.head_dim)
    return jnp.einsum("bshk,hkd->bsd", out, p["wo"])


def mlp(p, x):
    return (jax.nn.silu(x @ p["w_gate"]) * (x @ p["w_up"])) @ p["w_down"]


def forward(params, tokens, cfg: LlamaConfig):
    x = params["embed"][tokens]
    for p in params["layers"]:
        x = x + attention(p, rms_norm(x, p["attn_norm"]), cfg)
        x = x + mlp(p, rms_norm(x, p["mlp_norm"]))
    return rms_norm(x, params["final_norm"]) @ params["lm_head"]


def _abstract_params(cfg: LlamaConfig):
    f32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.float32)
    d, h, k, dh, f = cfg.d_model, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.hidden
    layer = {
        "attn_norm": f32((d,)), "wq": f32((d, h, dh)), "wk": f32((d, k, dh)), "wv": f32((d, k, dh)),
        "wo": f32((h, dh, d)), "mlp_norm": f32((d,)), "w_gate": f32((d, f)), "w_up": f32((d, f)),
        "w_down": f32((f, d)),
    }
    return {
        "embed": f32((cfg.vocab, d)),
        "layers": [dict(layer) for _ in range(cfg.layers)],
        "final_norm": f32((d,)),
        "lm_head": f32((d, cfg.vocab)),
    }



def llama_gqa(cfg: LlamaConfig | None = None) -> Workload:
    """The GQA decoder of `cfg` as a `Workload` (loss: next-token cross-entropy).

    >>> import jax
    >>> w = llama_gqa(LlamaConfig())
    >>> state, batch = w.init(0)
    >>> bool(abs(float(w.loss_fn(state["params"], batch)) - jax.numpy.log(64)) < 0.2)
    True
    """
    cfg = LlamaConfig() if cfg is None else cfg
    if cfg.heads % cfg.kv_heads or cfg.head_dim % 2:
        raise ValueError(f"LlamaConfig: heads={cfg.heads} must be a multiple of kv_heads={cfg.kv_heads} "
                         f"and head_dim={cfg.head_dim} even")

    def loss_fn(params, batch):
        logits = forward(params, batch["tokens"], cfg)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    return make_workload(
        f"llama_gqa_l{cfg.layers}",
        cfg,
        loss_fn=loss_fn,
        abstract_params=functools.partial(_abstract_params, cfg),
        fill_param=fill_param,
        abstract_batch=functools.partial(lm_abstract_batch, cfg.batch, cfg.seq),
        make_batch=lambda seed: lm_batch(vocab=cfg.vocab, batch=cfg.batch, seq=cfg.seq, seed=seed),
        learning_rate=cfg.learning_rate,
    )
