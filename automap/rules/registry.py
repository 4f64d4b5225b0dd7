"""The factor-rule table: one rule per primitive, in the style of JAX's own interpreters.

A *factor rule* says, for one application of a primitive, which dimensions of which operands
and results move together. Every dimension is a tuple of factor indices (major to minor; a
reshape merges or splits factors, so a dim may hold several); ``()`` marks a dimension that can
never be sharded (size one, or an index dimension). A factor is ``parallel`` (sharding it shards
the work), ``reduction`` (it appears only in operands: sharding it leaves a partial result that
needs an all-reduce or reduce-scatter), ``blocked`` (it must stay whole, e.g. the sorted dim) or
``permutation`` (it lays pieces side by side along one dim, a concatenation's: it may stay
sharded, each device's block then gathered from others' by all-to-alls, as XLA's partitioner
does, rather than the whole dim gathered).

Rules take a :class:`RuleContext` first and the primitive's params as keywords last, so a new
param in a JAX release never breaks a rule. The primitive's traits (its FLOPs, fusion, memory,
emission pins, contraction: :mod:`automap.rules.traits`) are declared in the same call, so a
primitive is one entry::

    @register(lax.dot_general_p, traits=contraction(_contracted_dims))
    def _dot(ctx, *, dimension_numbers, **_):
        ...
        return einsum(ctx, "bmk,bkn->bmn")
"""
from __future__ import annotations

import dataclasses
import math
import string
import warnings
from typing import Any, Callable, Literal, Mapping, Sequence

from automap.rules.traits import ELEMENTWISE, KERNEL, REDUCTION, Traits, declare

FactorKind = Literal["parallel", "reduction", "blocked", "permutation"]
DimFactors = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Factor:
    size: int
    kind: FactorKind = "parallel"


@dataclasses.dataclass(frozen=True)
class FactorRule:
    """Factors of one op; ``operands[i][d]`` / ``results[j][d]`` are the factors of dim ``d``."""

    factors: tuple[Factor, ...]
    operands: tuple[tuple[DimFactors, ...], ...]
    results: tuple[tuple[DimFactors, ...], ...]
    # group id per factor: a mesh axis may shard at most one factor *of a group* (empty: one group).
    # Control-flow links tie many independent values in one op: each tie is its own group.
    groups: tuple[int, ...] = ()
    # factors the op takes before any other, whatever the order of the decisions behind them
    # (XLA's partitioner runs a feature-grouped convolution in its groups' layout)
    leading: tuple[int, ...] = ()

    def group(self, factor: int) -> int:
        return self.groups[factor] if self.groups else 0

    @property
    def reduction_factors(self) -> tuple[int, ...]:
        return tuple(i for i, f in enumerate(self.factors) if f.kind == "reduction")


@dataclasses.dataclass(frozen=True)
class Shaped:
    """What a rule knows of an operand or result: its shape and dtype."""

    shape: tuple[int, ...]
    dtype: Any

    @property
    def ndim(self) -> int:
        return len(self.shape)


@dataclasses.dataclass(frozen=True)
class RuleContext:
    primitive: str
    operands: tuple[Shaped, ...]
    results: tuple[Shaped, ...]
    source: str = ""
    value: str = ""  # the name of the op's first result, for messages


Rule = Callable[..., FactorRule]  # rule(ctx: RuleContext, **params) -> FactorRule

RULES: dict[str, Rule] = {}


class MissingRuleError(NotImplementedError):
    """Raised in strict mode when a primitive has no factor rule."""


class MissingRuleWarning(UserWarning):
    """Warned outside strict mode when a primitive has no factor rule (it is replicated around)."""


def _name(primitive: Any) -> str:
    return primitive if isinstance(primitive, str) else primitive.name


def register(*primitives: Any, traits: Traits | None = None) -> Callable[[Rule], Rule]:
    """Decorator registering ``rule`` for each primitive (a ``Primitive`` or its name), with its
    cost and emission ``traits`` (:mod:`automap.rules.traits`; without them the primitive gets
    the conservative ``UNKNOWN`` traits, and the traits test names it)."""
    if traits is not None:
        declare(*primitives, traits=traits)

    def wrap(rule: Rule) -> Rule:
        for p in primitives:
            RULES[_name(p)] = rule
        return rule

    return wrap


def has_rule(primitive: Any) -> bool:
    return _name(primitive) in RULES


def rule_for(ctx: RuleContext, params: Mapping[str, Any], *, strict: bool,
             primitive: Any = None) -> tuple[FactorRule, bool]:
    """The op's factor rule and whether it is a real rule (False: the replicate-around default).

    A primitive without a hand-written rule gets one derived from XLA
    (:func:`automap.rules.derive.derive_rule`) when ``primitive`` (the ``Primitive`` object,
    needed to bind it) is given; only where that fails is it an error (``strict``) or
    replicated around with a :class:`MissingRuleWarning` naming the primitive, the source line
    and why no rule could be derived.
    """
    rule = RULES.get(ctx.primitive)
    if rule is not None:
        return rule(ctx, **params), True
    why = ""
    if primitive is not None:
        from automap.rules.derive import derive_rule

        derived = derive_rule(primitive, ctx, params)
        if derived.rule is not None:
            return derived.rule, True
        why = f" No rule could be derived from XLA: {derived.reason}."
    value = f"value '{ctx.value}', " if ctx.value else ""
    where = f"primitive '{ctx.primitive}' ({value}at {ctx.source or '?'}, operands {_shapes(ctx.operands)})"
    if strict:
        raise MissingRuleError(
            f"automap has no factor rule for {where}.{why} "
            "Register one with automap.rules.register, or pass strict=False to replicate around it."
        )
    warnings.warn(
        f"automap has no factor rule for {where}: its operands and results stay replicated.{why} "
        "Register one with automap.rules.register.",
        MissingRuleWarning,
        stacklevel=2,
    )
    return replicated(ctx), False


def is_derived(primitive: str) -> bool:
    """Whether ops of ``primitive`` get a rule derived from XLA (no hand-written rule)."""
    return primitive not in RULES


def _shapes(values: Sequence[Shaped]) -> str:
    return ", ".join(f"{getattr(s.dtype, 'name', s.dtype)}{list(s.shape)}" for s in values) or "none"


# ---------------------------------------------------------------------------------------------
# builders used by the rule families


def replicated(ctx: RuleContext) -> FactorRule:
    """The conservative default: every dim of every operand and result stays whole."""
    factors: list[Factor] = []

    def dims(s: Shaped) -> tuple[DimFactors, ...]:
        out = []
        for size in s.shape:
            factors.append(Factor(size, "blocked"))
            out.append((len(factors) - 1,))
        return tuple(out)

    ops = tuple(dims(s) for s in ctx.operands)
    res = tuple(dims(s) for s in ctx.results)
    return FactorRule(tuple(factors), ops, res)


def einsum(ctx: RuleContext, spec: str, *, blocked: str = "", permuted: str = "") -> FactorRule:
    """Rule from an einsum-like string, one letter per dim: ``"bmk,bkn->bmn"``.

    Letters present only left of ``->`` are reductions; letters in ``blocked`` never shard;
    letters in ``permuted`` are permutation factors, their dims of different sizes (the factor's
    size is their greatest common divisor, so a tiling of it tiles each);
    ``.`` marks a dim that gets no factor (size one, or unshardable on its own). Operands that
    are scalars may be given as empty strings (``"ab,->ab"``).
    """
    lhs, rhs = spec.split("->")
    ins = lhs.split(",") if lhs or ctx.operands else []
    outs = rhs.split(",") if rhs or ctx.results else []
    if len(ins) != len(ctx.operands) or len(outs) != len(ctx.results):
        raise ValueError(f"rule {spec!r} does not match {ctx.primitive} with {len(ctx.operands)} operands")
    index: dict[str, int] = {}
    sizes: dict[str, int] = {}
    for term, s in zip(ins + outs, ctx.operands + ctx.results, strict=True):
        if len(term) != s.ndim:
            raise ValueError(f"rule {spec!r}: term {term!r} has {len(term)} dims, value has shape {s.shape}")
        for letter, size in zip(term, s.shape, strict=True):
            if letter == ".":
                continue
            index.setdefault(letter, len(index))
            sizes[letter] = math.gcd(sizes[letter], size) if letter in permuted and letter in sizes else size
    out_letters = set("".join(outs))
    factors = []
    for letter in index:
        kind: FactorKind = "parallel"
        if letter in blocked:
            kind = "blocked"
        elif letter in permuted:
            kind = "permutation"
        elif letter not in out_letters:
            kind = "reduction"
        factors.append(Factor(sizes[letter], kind))

    def dims(term: str) -> tuple[DimFactors, ...]:
        return tuple(() if c == "." else (index[c],) for c in term)

    return FactorRule(tuple(factors), tuple(dims(t) for t in ins), tuple(dims(t) for t in outs))


def letters(n: int, skip: str = "") -> str:
    """``n`` distinct factor letters, avoiding those in ``skip``."""
    pool = [c for c in string.ascii_letters if c not in skip]
    if n > len(pool):
        raise ValueError(f"rank {n} is too large for a letter rule")
    return "".join(pool[:n])


def def_elementwise(*primitives: Any, traits: Traits = ELEMENTWISE) -> None:
    """Same-shape operands and results, every dim one parallel factor; scalar operands broadcast.
    Traits default to ``ELEMENTWISE`` (fused, one FLOP per result element)."""

    def rule(ctx: RuleContext, **_: Any) -> FactorRule:
        out = ctx.results[0].shape
        term = letters(len(out))

        def operand_term(s: Shaped) -> str:
            if s.ndim != len(out):  # a scalar operand
                return "." * s.ndim
            # rank-equal implicit broadcasting: size-1 dims get no factor
            return "".join(c if n == m else "." for c, n, m in zip(term, s.shape, out, strict=True))

        ins = [operand_term(s) for s in ctx.operands]
        return einsum(ctx, ",".join(ins) + "->" + ",".join(term for _ in ctx.results))

    register(*primitives, traits=traits)(rule)


def def_reduce(*primitives: Any, traits: Traits = REDUCTION) -> None:
    """Reductions over ``axes``: reduced dims are reduction factors (a partial result when sharded).
    Traits default to ``REDUCTION`` (a buffer result, one FLOP per operand element)."""

    def rule(ctx: RuleContext, *, axes: Sequence[int], **_: Any) -> FactorRule:
        rank = ctx.operands[0].ndim
        term = letters(rank)
        kept = "".join(c for i, c in enumerate(term) if i not in set(axes))
        return einsum(ctx, ",".join(term for _ in ctx.operands) + "->" + ",".join(kept for _ in ctx.results))

    register(*primitives, traits=traits)(rule)


def def_blocked_along(*primitives: Any, param: str, traits: Traits = KERNEL) -> None:
    """Same-shape ops that must see the whole of dim ``params[param]`` (cumsum, sort, ...).
    Traits default to ``KERNEL`` (a kernel of its own, one FLOP per operand element)."""

    def rule(ctx: RuleContext, **params: Any) -> FactorRule:
        rank = ctx.operands[0].ndim
        axis = params[param] % rank if rank else 0
        term = letters(rank)
        return einsum(
            ctx,
            ",".join(term for _ in ctx.operands) + "->" + ",".join(term for _ in ctx.results),
            blocked=term[axis] if rank else "",
        )

    register(*primitives, traits=traits)(rule)
