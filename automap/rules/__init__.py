"""Per-primitive records: a factor rule and its traits (cost, fusion, memory, emission,
contraction) per primitive. Importing this package registers every family.

A primitive without a hand-written rule gets one derived from XLA (:mod:`automap.rules.derive`);
the few that must stay whole are listed with their reason in
:data:`~automap.rules.unshardable.UNSHARDABLE`.
"""
from automap.rules import (  # noqa: F401
    attention, control_flow, dot, elementwise, indexing, random, reduce, shape, unshardable, user_annotations,
)
from automap.rules.control_flow import STRUCTURAL
from automap.rules.derive import Derivation, derive_rule
from automap.rules.record import Record, record, undeclared
from automap.rules.registry import (
    RULES, Factor, FactorRule, MissingRuleError, MissingRuleWarning, RuleContext, Shaped, def_blocked_along,
    def_elementwise, def_reduce, einsum, has_rule, register, replicated,
)
from automap.rules.traits import TRAITS, Contraction, Lookup, Traits, contraction, declare, traits_of
from automap.rules.unshardable import UNREACHABLE, UNSHARDABLE


def covered(primitive: str) -> bool:
    """Whether automap has a hand-written rule for ``primitive`` or handles it structurally
    (others get a rule derived from XLA where possible: :func:`derive_rule`)."""
    return primitive in RULES or primitive in STRUCTURAL


__all__ = [
    "RULES", "STRUCTURAL", "TRAITS", "UNREACHABLE", "UNSHARDABLE", "Contraction", "Derivation", "Factor",
    "FactorRule", "Lookup", "MissingRuleError", "MissingRuleWarning", "Record", "RuleContext", "Shaped", "Traits",
    "contraction", "covered", "declare", "def_blocked_along", "def_elementwise", "def_reduce", "derive_rule",
    "einsum", "has_rule", "record", "register", "replicated", "traits_of", "undeclared",
]
