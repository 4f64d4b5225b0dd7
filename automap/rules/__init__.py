"""Per-primitive factor rules. Importing this package registers every family."""
from automap.rules import control_flow, dot, elementwise, indexing, random, reduce, shape, user_annotations  # noqa: F401
from automap.rules.control_flow import STRUCTURAL
from automap.rules.registry import (
    RULES, Factor, FactorRule, MissingRuleError, MissingRuleWarning, RuleContext, Shaped, def_blocked_along,
    def_elementwise, def_reduce, einsum, has_rule, register, replicated,
)


def covered(primitive: str) -> bool:
    """Whether automap knows how to partition ``primitive`` (a rule, or structural handling)."""
    return primitive in RULES or primitive in STRUCTURAL


__all__ = [
    "RULES", "STRUCTURAL", "Factor", "FactorRule", "MissingRuleError", "MissingRuleWarning", "RuleContext", "Shaped",
    "covered", "def_blocked_along", "def_elementwise", "def_reduce", "einsum", "has_rule", "register", "replicated",
]
