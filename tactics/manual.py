"""``manual``: a user's partial plan, regular expressions on input pytree paths to PartitionSpecs."""
from __future__ import annotations

import dataclasses
import re
import warnings
from typing import Mapping, Sequence, Union

from jax.sharding import PartitionSpec

from automap.propagate import apply
from automap.shardings import ShardingError, ShardingState, actions_for, from_partition_spec
from tactics.base import PlanContext, TacticResult

Rules = Union[Mapping[str, PartitionSpec], Sequence[tuple[str, PartitionSpec]]]


@dataclasses.dataclass(frozen=True)
class Manual:
    rules: tuple[tuple[str, PartitionSpec], ...]
    name: str = "manual"

    def __call__(self, ctx: PlanContext, state: ShardingState) -> TacticResult:
        program = ctx.program
        matched: dict[int, list[int]] = {i: [] for i in range(len(self.rules))}
        for vid, path in zip(program.inputs, program.input_paths, strict=True):
            for i, (pattern, _) in enumerate(self.rules):
                if re.search(pattern, path):
                    matched[i].append(vid)
                    break
        data = set(ctx.data_inputs)
        # two decisions: the rules on the batch first, then the rest. Activations keep the batch
        # layout when a parameter's spec disagrees (FSDP gathers the parameter instead).
        groups: dict[bool, tuple[list, list[int]]] = {True: ([], []), False: ([], [])}
        notes, reasons = [], {}
        for i, (pattern, pspec) in enumerate(self.rules):
            if not matched[i]:
                warnings.warn(
                    f"manual rule {pattern!r} matched no input path; the input paths are "
                    f"{', '.join(program.input_paths)} (rules are regexes searched in each path)",
                    stacklevel=2,
                )
                continue
            for vid in matched[i]:
                value = program.values[vid]
                where = f"input '{value.name}' (shape {value.shape}), manual rule {pattern!r} -> {pspec}"
                spec = from_partition_spec(pspec, value.ndim, where=where)
                actions, frozen = groups[vid in data]
                actions.extend((a, where) for a in actions_for(vid, spec))
                frozen.append(vid)
                reasons[vid] = f"manual {pattern!r}"
            notes.append(f"manual {pattern!r} -> {pspec}: {len(matched[i])} inputs")
        # every input a rule names is frozen from the first decision on, so that propagation from
        # the batch never adds axes to a parameter the user gives a spec of its own
        pinned = groups[True][1] + groups[False][1]
        for is_data in (True, False):
            actions, frozen = groups[is_data]
            if not frozen:
                continue
            check = state  # check the actions one after another, as apply() applies them
            for action, where in actions:
                try:
                    check.check_action(action)
                except ShardingError as e:
                    raise ShardingError(f"{e} ({where})") from None
                spec = list(check.spec(action.value))
                spec[action.dim] += (action.axis,)
                check = check.replace(specs={**check.specs, action.value: tuple(spec)})
            label = "manual rules on the batch" if is_data else "manual rules"
            state = apply(state, [a for a, _ in actions], freeze=pinned, label=label)
        return TacticResult(state, tuple(notes), reasons=reasons)


def manual(rules: Rules) -> Manual:
    """A tactic pinning the inputs whose pytree path matches a regex (``re.search``; the first
    matching rule wins) to a ``PartitionSpec``; everything else follows by propagation.

    >>> from jax.sharding import PartitionSpec as P
    >>> t = manual({r"kernel$": P(None, "model"), r"^batch/": P("data")})
    >>> t.rules[0]
    ('kernel$', P(None, 'model'))
    """
    items = tuple(rules.items()) if isinstance(rules, Mapping) else tuple(rules)
    for pattern, pspec in items:
        if not isinstance(pattern, str):
            raise TypeError(f"manual rule {pattern!r}: the key must be a regex string matching input paths")
        try:
            re.compile(pattern)
        except re.error as e:  # still a re.error, now naming the rule
            raise re.error(f"manual rule {pattern!r} is not a valid regex: {e.msg} (at position {e.pos}); escape "
                           "special characters (re.escape, or a backslash as in r'layers\\[0\\]')", pattern) from None
        if not isinstance(pspec, PartitionSpec):
            raise TypeError(f"manual rule {pattern!r}: expected a jax.sharding.PartitionSpec, got {pspec!r}")
    return Manual(items)
