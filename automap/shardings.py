"""Sharding state: for each value, which mesh axes tile which of its dims.

A spec is a tuple with one entry per dim, each a tuple of mesh axis names (major to minor);
``()`` is a whole dim. A mesh axis tiles at most one dim of a value. A value absent from
:attr:`ShardingState.specs` is replicated. Every assigned dim remembers the *priority* of the
decision it came from (lower is earlier), so that when two decisions disagree at an op the
earlier one wins and the other becomes a resharding collective.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Iterable, Mapping

from jax.sharding import PartitionSpec

from automap.ir.program import Program, Value

Spec = tuple[tuple[str, ...], ...]


class ShardingError(ValueError):
    """A sharding that cannot be applied: the message names the value, the dim and the fix."""


@dataclasses.dataclass(frozen=True)
class Action:
    """Tile dim ``dim`` of value ``value`` along mesh axis ``axis``."""

    value: int
    dim: int
    axis: str


@dataclasses.dataclass(frozen=True, eq=False)
class ShardingState:
    program: Program
    axes: Mapping[str, int]  # mesh axis name -> size, in mesh order
    specs: Mapping[int, Spec] = dataclasses.field(default_factory=dict)
    priority: Mapping[tuple[int, int], int] = dataclasses.field(default_factory=dict)
    frozen: frozenset[int] = frozenset()  # values whose spec propagation must not change
    next_priority: int = 0
    labels: Mapping[int, str] = dataclasses.field(default_factory=dict)  # priority -> why

    def why(self, vid: int, dim: int) -> str:
        """The decision that sharded this dim (a tactic's label), or '' if it is whole."""
        if not self.spec(vid)[dim]:
            return ""
        return self.labels.get(self.priority.get((vid, dim), -1), "")

    @staticmethod
    def initial(program: Program, axes: Mapping[str, int]) -> "ShardingState":
        return ShardingState(program, dict(axes))

    def spec(self, vid: int) -> Spec:
        got = self.specs.get(vid)
        if got is None:
            return tuple(() for _ in self.program.values[vid].shape)
        return got

    def partition_spec(self, vid: int) -> PartitionSpec:
        return to_partition_spec(self.spec(vid))

    def shards(self, vid: int) -> int:
        """Into how many pieces the value is split (the product of the sizes of its axes)."""
        return math.prod(self.axes[a] for dim in self.spec(vid) for a in dim)

    def bytes_per_device(self, vid: int) -> int:
        return self.program.values[vid].nbytes // self.shards(vid)

    def key(self) -> frozenset:
        """Hashable identity of the assignment (for transposition tables); computed once, as a
        state's specs do not change after it is made."""
        got = self.memo.get("key")
        if got is None:
            got = self.memo["key"] = frozenset(self.specs.items())
        return got

    def inherit_key(self, parent: "ShardingState", changed: Iterable[int]) -> None:
        """Derive :meth:`key` from ``parent``'s, if that is known, for a state whose specs differ
        from ``parent``'s only at the values in ``changed`` (cheaper than hashing every spec)."""
        parent_key = parent.memo.get("key")
        if parent_key is None or "key" in self.memo:
            return
        changed = list(changed)
        removed = [(v, parent.specs[v]) for v in changed if v in parent.specs]
        added = [(v, self.specs[v]) for v in changed if v in self.specs]
        self.memo["key"] = parent_key.difference(removed).union(added)

    @functools.cached_property
    def memo(self) -> dict:
        """Data derived from this state, computed once (its key, the cost model's analysis)."""
        return {}

    @functools.cached_property
    def mesh_key(self) -> tuple[tuple[str, int], ...]:
        """The mesh as a hashable key: (axis name, size) in mesh order."""
        return tuple(self.axes.items())

    def replace(self, **changes: Any) -> "ShardingState":
        return dataclasses.replace(self, **changes)

    def check_action(self, action: Action) -> None:
        """Raise :class:`ShardingError` if ``action`` is not legal in this state."""
        check_action(self.program, self.axes, self.specs.get(action.value), action)


def check_action(program: Program, axes: Mapping[str, int], spec: Spec | None, action: Action) -> None:
    """Raise :class:`ShardingError` if ``action`` is not legal for a value whose spec is ``spec``
    (None: replicated)."""
    value = program.values[action.value]
    if action.axis not in axes:
        raise ShardingError(
            f"mesh axis '{action.axis}' for {_where(value)} is not a mesh axis; the mesh has "
            f"{tuple(axes)}: use one of those names"
        )
    if not 0 <= action.dim < value.ndim:
        raise ShardingError(f"dim {action.dim} is out of range for {_where(value)}")
    if spec is None:
        spec = tuple(() for _ in value.shape)
    for d, used in enumerate(spec):
        if action.axis in used:
            raise ShardingError(
                f"mesh axis '{action.axis}' already tiles dim {d} of {_where(value)}; "
                "a mesh axis may tile at most one dim of a value"
            )
    pieces = math.prod(axes[a] for a in spec[action.dim]) * axes[action.axis]
    if value.shape[action.dim] % pieces:
        raise ShardingError(
            f"dim {action.dim} of {_where(value)} has size {value.shape[action.dim]}, not divisible by "
            f"{pieces} (mesh axes {spec[action.dim] + (action.axis,)}); choose an axis that divides it "
            "or pad the dimension"
        )


def _where(value: Value) -> str:
    return f"value '{value.name}' (#{value.id}, shape {value.shape})"


def to_partition_spec(spec: Spec) -> PartitionSpec:
    entries: list[Any] = [None if not a else (a[0] if len(a) == 1 else tuple(a)) for a in spec]
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


def from_partition_spec(pspec: PartitionSpec | Iterable[Any] | None, ndim: int, *, where: str = "value") -> Spec:
    """A Spec from a ``PartitionSpec`` (``None``, a name or a tuple of names per dim)."""
    if pspec is None:
        return tuple(() for _ in range(ndim))
    entries = list(pspec)
    if len(entries) > ndim:
        raise ShardingError(
            f"PartitionSpec {pspec} has {len(entries)} entries but {where} has only {ndim} dims; "
            f"give at most {ndim} entries"
        )
    out: list[tuple[str, ...]] = []
    seen: set[str] = set()
    for entry in entries + [None] * (ndim - len(entries)):
        if entry is None or entry is PartitionSpec.UNCONSTRAINED:
            axes: tuple[str, ...] = ()
        elif isinstance(entry, str):
            axes = (entry,)
        else:
            axes = tuple(entry)
        for a in axes:
            if a in seen:
                raise ShardingError(
                    f"PartitionSpec {pspec} for {where} uses mesh axis '{a}' twice; a mesh axis may tile "
                    "at most one dim of a value: remove one of its uses"
                )
            seen.add(a)
        out.append(axes)
    return tuple(out)


def actions_for(vid: int, spec: Spec) -> list[Action]:
    return [Action(vid, d, a) for d, axes in enumerate(spec) for a in axes]


def format_spec(spec: Spec) -> str:
    return "(" + ", ".join("-" if not a else "+".join(a) for a in spec) + ")"
