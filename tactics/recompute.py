"""``recompute(way)``: activation checkpointing as an expert writes it into a plan.

Every repeated block (:func:`automap.ir.recompute.repeated_blocks`: numbered layers, layers found
by their parameters, the body of a ``scan`` over layers) is recomputed in the backward pass,
``"selective"`` (Megatron-LM's selective recomputation: the weight matmuls' results kept, the
attention core, norms and activations redone) or ``"full"`` (only each block's input kept). The
search does the same on its own when no plan fits the memory budget (:mod:`search.recompute`);
this tactic is for hand-written plans such as Megatron-LM's "Reducing Activation Recomputation"
recipe: ``schedule(data_parallel("data"), megatron("model"), sequence_parallel("model"),
recompute("selective"))``, on a model written with remat of every layer ``recompute("selective",
user_remat="drop")``. Put it last: the recomputed copies take the layouts decided before it.

>>> import tactics
>>> tactics.recompute("selective").name
'recompute'
"""
from __future__ import annotations

import dataclasses
from typing import Literal

from automap.ir.recompute import recompute_state, repeated_blocks, selective
from automap.ir.unremat import drop_remat_state, has_user_remat
from automap.shardings import ShardingState
from tactics.base import PlanContext, TacticResult

Way = Literal["selective", "full", "none"]
UserRemat = Literal["keep", "drop"]


@dataclasses.dataclass(frozen=True)
class Recompute:
    way: Way = "selective"
    user_remat: UserRemat = "keep"
    name: str = "recompute"

    def __call__(self, ctx: PlanContext, state: ShardingState) -> TacticResult:
        notes = []
        if self.user_remat == "drop" and has_user_remat(state.program):
            notes.append(f"recompute: dropped the model's remat ({len(state.program.remat_calls)} call(s))")
            state = drop_remat_state(state)
        if self.way == "none":
            return TacticResult(state, tuple(notes) or ("recompute (none): no remat to drop",))
        blocks = repeated_blocks(state.program)
        names = [selective(b) if self.way == "selective" else b for b in blocks]
        got = recompute_state(state, names)
        done = got.program.recomputed[len(state.program.recomputed):]
        note = f"recompute ({self.way}): {', '.join(done)}" if done else f"recompute ({self.way}): no repeated block"
        return TacticResult(got, (*notes, note))


def recompute(way: Way = "selective", user_remat: UserRemat = "keep") -> Recompute:
    """Recompute every repeated block in the backward pass, ``"selective"`` or ``"full"`` (module
    docstring), or none (``"none"``). ``user_remat="drop"`` first drops the model's own
    ``jax.checkpoint``/``nn.remat`` (:func:`automap.ir.unremat.drop_remat`): ``recompute("selective",
    user_remat="drop")`` plans a model written with remat of every layer as Megatron-LM's selective
    recomputation; with ``"keep"`` (the default) blocks under the model's remat are left as they are.

    >>> recompute("full").way, recompute("none", user_remat="drop").user_remat
    ('full', 'drop')
    >>> recompute("some")
    Traceback (most recent call last):
    ...
    ValueError: recompute(way='some'): expected 'selective', 'full' or 'none'
    """
    if way not in ("selective", "full", "none"):
        raise ValueError(f"recompute(way={way!r}): expected 'selective', 'full' or 'none'")
    if user_remat not in ("keep", "drop"):
        raise ValueError(f"recompute(user_remat={user_remat!r}): expected 'keep' or 'drop'")
    return Recompute(way, user_remat)
