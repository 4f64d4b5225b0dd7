"""The built-in default until search lands: shard the leading (batch) dim of every data input
over all mesh axes whose sizes divide it, in mesh order."""
from __future__ import annotations

import dataclasses

from automap.propagate import apply
from automap.shardings import Action, ShardingState
from tactics.base import PlanContext, TacticResult


@dataclasses.dataclass(frozen=True)
class BatchOverAllAxes:
    name: str = "batch"

    def __call__(self, ctx: PlanContext, state: ShardingState) -> TacticResult:
        actions = []
        program = ctx.program
        for vid in ctx.data_inputs:
            value = program.values[vid]
            if value.ndim == 0 or vid in state.frozen:  # frozen: the user's own sharding (shard_map)
                continue
            spec = state.spec(vid)
            used = {a for dim in spec for a in dim}
            pieces = 1
            for axis in spec[0]:
                pieces *= ctx.axes[axis]
            for axis, size in ctx.axes.items():
                if value.shape[0] % (pieces * size) == 0 and size > 1 and axis not in used:
                    actions.append(Action(vid, 0, axis))
                    pieces *= size
        if not actions:
            return TacticResult(state, ("batch: no data input has a leading dim divisible by a mesh axis",))
        axes = sorted({a.axis for a in actions}, key=list(ctx.axes).index)
        label = f"batch dim over {'+'.join(axes)}"
        state = apply(state, actions, label=label)
        reasons = {a.value: label for a in actions}
        return TacticResult(state, (f"batch: leading dim of {len(ctx.data_inputs)} data inputs over {axes}",), reasons=reasons)


def batch_over_all_axes() -> BatchOverAllAxes:
    """The default plan: data inputs split by their leading dim over every mesh axis that divides it.

    >>> batch_over_all_axes().name
    'batch'
    """
    return BatchOverAllAxes()
