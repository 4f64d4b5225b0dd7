"""``recompute(way)``: activation checkpointing as an expert writes it into a plan.

Every repeated block (:func:`automap.ir.recompute.repeated_blocks`: numbered layers, layers found
by their parameters, the body of a ``scan`` over layers) is recomputed in the backward pass,
``"selective"`` (Megatron-LM's selective recomputation: the weight matmuls' results kept, the
attention core, norms and activations redone) or ``"full"`` (only each block's input kept). The
search does the same on its own when no plan fits the memory budget (:mod:`search.recompute`);
this tactic is for hand-written plans such as Megatron-LM's "Reducing Activation Recomputation"
recipe: ``schedule(data_parallel("data"), megatron("model"), sequence_parallel("model"),
recompute("selective"))``. Put it last: the recomputed copies take the layouts decided before it.

>>> import tactics
>>> tactics.recompute("selective").name
'recompute'
"""
from __future__ import annotations

import dataclasses
from typing import Literal

from automap.ir.recompute import recompute_state, repeated_blocks, selective
from automap.shardings import ShardingState
from tactics.base import PlanContext, TacticResult

Way = Literal["selective", "full"]


@dataclasses.dataclass(frozen=True)
class Recompute:
    way: Way = "selective"
    name: str = "recompute"

    def __call__(self, ctx: PlanContext, state: ShardingState) -> TacticResult:
        blocks = repeated_blocks(state.program)
        names = [selective(b) if self.way == "selective" else b for b in blocks]
        got = recompute_state(state, names)
        done = got.program.recomputed[len(state.program.recomputed):]
        note = f"recompute ({self.way}): {', '.join(done)}" if done else f"recompute ({self.way}): no repeated block"
        return TacticResult(got, (note,))


def recompute(way: Way = "selective") -> Recompute:
    """Recompute every repeated block in the backward pass, ``"selective"`` or ``"full"`` (module docstring).

    >>> recompute("full").way
    'full'
    >>> recompute("some")
    Traceback (most recent call last):
    ...
    ValueError: recompute(way='some'): expected 'selective' or 'full'
    """
    if way not in ("selective", "full"):
        raise ValueError(f"recompute(way={way!r}): expected 'selective' or 'full'")
    return Recompute(way)
