"""One record per primitive: its factor rule and its traits, read from the two tables that
``register`` fills together (:data:`~automap.rules.registry.RULES`, :data:`~automap.rules.traits.TRAITS`)."""
from __future__ import annotations

import dataclasses
from typing import Any

from automap.rules.control_flow import STRUCTURAL
from automap.rules.registry import RULES, Rule, _name
from automap.rules.traits import TRAITS, UNKNOWN, Traits


@dataclasses.dataclass(frozen=True)
class Record:
    """What automap knows of ``primitive``. ``rule`` is None for the structural primitives
    (``scan``, ``cond``, ``while``: linked by the lowering) and for a primitive without a rule;
    ``declared`` is False where the traits are the :data:`~automap.rules.traits.UNKNOWN` default."""

    primitive: str
    rule: Rule | None
    traits: Traits
    declared: bool


def record(primitive: Any) -> Record:
    """The record of ``primitive`` (a ``Primitive`` or its name).

    >>> r = record("dot_general")
    >>> r.traits.matmul, r.traits.pinned, r.declared
    (True, True, True)
    >>> record("no_such_op").traits.materializing, record("no_such_op").declared
    (True, False)
    """
    name = _name(primitive)
    traits = TRAITS.get(name)
    return Record(name, RULES.get(name), traits or UNKNOWN, traits is not None)


def undeclared() -> list[str]:
    """Primitives with a rule (or structural handling) but no declared traits: each should
    get ``traits=`` at its ``register`` (or a family helper)."""
    structural = {p for p in STRUCTURAL if p in ("scan", "cond", "while")}
    return sorted(p for p in set(RULES) | structural if p not in TRAITS)
