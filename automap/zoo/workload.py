"""The `Workload` bundle every zoo model returns, and the GPT config shared by both front ends.

A workload is everything a partitioner, a test or a benchmark needs about one training problem:
a pure `train_step(state, batch) -> (state, loss)`, the `loss_fn(params, batch)` it differentiates,
and two ways to get example arguments: `init(seed)` (small concrete arrays) and `abstract()`
(`jax.ShapeDtypeStruct` pytrees, nothing allocated).

>>> from automap import zoo
>>> w = zoo.gpt_linen(zoo.GPTConfig(layers=1, d_model=32, heads=2, vocab=64, seq=8, batch=2))
>>> state, batch = w.abstract()
>>> sorted(state), sorted(batch)
(['opt_state', 'params'], ['targets', 'tokens'])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

PyTree = Any


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Size and variant switches of the GPT-2 style decoder (`gpt_linen` and `gpt_nnx`).

    `d_model` must be divisible by `heads`, and `heads` by `kv_heads` (key/value heads: None is
    one per query head; fewer is grouped-query attention, 1 is multi-query). With fewer key/value
    heads the projections are separate ``q``/``k``/``v`` (as with `separate_qkv`). `ffn` is the MLP
    width (None: ``mlp_ratio * d_model``; Llama-2-70B's 28672 is 3.5 x 8192). `dropout > 0` adds a `"rng"` entry (uint32[2] key data)
    to the batch so that the train step stays a pure function.

    >>> GPTConfig(layers=4, scan=True).layers
    4
    >>> llama2_70b = GPTConfig(vocab=32000, seq=4096, d_model=8192, heads=64, kv_heads=8, layers=80,
    ...                        ffn=28672, gated_mlp=True, scan=True, remat=True)
    >>> llama2_70b.head_dim, llama2_70b.hidden, llama2_70b.fused_qkv
    (128, 28672, False)
    """

    vocab: int = 256
    seq: int = 16
    d_model: int = 64
    heads: int = 4
    kv_heads: int | None = None
    layers: int = 2
    mlp_ratio: int = 4
    ffn: int | None = None
    batch: int = 8
    scan: bool = False
    remat: bool = False
    dropout: float = 0.0
    gated_mlp: bool = False
    separate_qkv: bool = False
    learning_rate: float = 1e-3

    def __post_init__(self):
        if self.d_model % self.heads:
            raise ValueError(
                f"GPTConfig: d_model={self.d_model} is not divisible by heads={self.heads}; "
                "pick d_model as a multiple of heads."
            )
        if self.kv_heads is not None and (self.kv_heads < 1 or self.heads % self.kv_heads):
            raise ValueError(
                f"GPTConfig: heads={self.heads} is not a multiple of kv_heads={self.kv_heads}; pick "
                "kv_heads dividing heads (None: one key/value head per query head)."
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig: dropout={self.dropout} must be in [0, 1).")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads

    @property
    def num_kv_heads(self) -> int:
        """Key/value heads: `kv_heads`, or `heads` when None."""
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def fused_qkv(self) -> bool:
        """One ``qkv`` projection (multi-head attention without `separate_qkv`)."""
        return not self.separate_qkv and self.num_kv_heads == self.heads

    @property
    def hidden(self) -> int:
        return self.mlp_ratio * self.d_model if self.ffn is None else self.ffn


def gpt_name(prefix: str, cfg: GPTConfig) -> str:
    """A short stable name such as ``gpt_linen_l2_scan_remat``."""
    flags = [
        ("scan", cfg.scan),
        ("remat", cfg.remat),
        ("gated", cfg.gated_mlp),
        ("sepqkv", cfg.separate_qkv),
        ("dropout", cfg.dropout > 0),
    ]
    kv = [f"kv{cfg.num_kv_heads}"] if cfg.num_kv_heads != cfg.heads else []
    return "_".join([prefix, f"l{cfg.layers}"] + [n for n, on in flags if on] + kv)


@dataclasses.dataclass(frozen=True)
class Workload:
    """One training problem: a pure train step plus ways to build its arguments.

    Attributes:
      name: short identifier, e.g. ``"gpt_linen_l2_scan"``.
      config: the frozen config the workload was built from.
      train_step: ``(state, batch) -> (new_state, loss)``; pure and jit-able.
      loss_fn: ``(params, batch) -> scalar loss``.
      init: ``(seed=0) -> (state, batch)`` with concrete arrays, deterministic for a seed.
      abstract: ``() -> (state, batch)`` as ``jax.ShapeDtypeStruct`` pytrees (no allocation).

    >>> from automap import zoo
    >>> w = zoo.mlp(zoo.MLPConfig(d_in=4, hidden=(8,), d_out=2, batch=2))
    >>> state, batch = w.init(0)
    >>> new_state, loss = jax.jit(w.train_step)(state, batch)
    >>> bool(loss > 0)
    True
    """

    name: str
    config: Any
    train_step: Callable[[PyTree, PyTree], tuple[PyTree, jax.Array]]
    loss_fn: Callable[[PyTree, PyTree], jax.Array]
    init: Callable[..., tuple[PyTree, PyTree]]
    abstract: Callable[[], tuple[PyTree, PyTree]]
