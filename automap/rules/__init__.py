"""Per-primitive records: a factor rule and its traits (cost, fusion, memory, emission,
contraction) per primitive. Importing this package registers every family."""
from automap.rules import control_flow, dot, elementwise, indexing, random, reduce, shape  # noqa: F401
from automap.rules.control_flow import STRUCTURAL
from automap.rules.record import Record, record, undeclared
from automap.rules.registry import (
    RULES, Factor, FactorRule, MissingRuleError, MissingRuleWarning, RuleContext, Shaped, def_blocked_along,
    def_elementwise, def_reduce, einsum, has_rule, register, replicated,
)
from automap.rules.traits import TRAITS, Contraction, Lookup, Traits, contraction, declare, traits_of


def covered(primitive: str) -> bool:
    """Whether automap knows how to partition ``primitive`` (a rule, or structural handling)."""
    return primitive in RULES or primitive in STRUCTURAL


__all__ = [
    "RULES", "STRUCTURAL", "TRAITS", "Contraction", "Factor", "FactorRule", "Lookup", "MissingRuleError",
    "MissingRuleWarning", "Record", "RuleContext", "Shaped", "Traits", "contraction", "covered", "declare",
    "def_blocked_along", "def_elementwise", "def_reduce", "einsum", "has_rule", "record", "register", "replicated",
    "traits_of", "undeclared",
]
