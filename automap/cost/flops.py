"""FLOPs and memory traffic of one op, from shapes alone (global, before partitioning).

What each primitive costs is its record's traits (:mod:`automap.rules.traits`): its ``flops``
function (or, given a ``platform``, the FLOPs of what that platform compiles:
:meth:`~automap.rules.traits.Traits.flops_on`), its ``fusion`` mode, whether it is a matmul.
"""
from __future__ import annotations

from automap.ir.program import Op, Program
from automap.rules import RuleContext, Shaped, Traits, traits_of
from automap.rules.dot import strength_reduced
from automap.rules.traits import no_flops


def context(program: Program, op: Op) -> RuleContext:
    """The op's :class:`RuleContext` (global shapes), as traits functions take it."""
    shaped = program.memo.get("shaped")
    if shaped is None:  # one Shaped per value, built once per program
        shaped = program.memo["shaped"] = [Shaped(v.shape, v.dtype) for v in program.values]
    return RuleContext(op.primitive, tuple(shaped[v] for v in op.inputs), tuple(shaped[v] for v in op.outputs),
                       op.source)


def _flops(program: Program, op: Op, traits: Traits, platform: str | None) -> int:
    fn = traits.flops_on(platform)
    if fn is no_flops:
        return 0
    return fn(context(program, op), **op.params)


def dot_flops(program: Program, op: Op, platform: str | None = None) -> int:
    """The FLOPs of a contraction (``2 * |result| * |contraction|`` for dot_general; convolutions
    too, as :func:`automap.measure` counts XLA's dot and convolution instructions) as ``platform``
    compiles it (None: its own arithmetic); 0 for anything else, and on XLA:CPU for a dot whose
    operands have no free dims (:func:`automap.rules.dot.strength_reduced`: no dot instruction).

    >>> import jax, jax.numpy as jnp
    >>> from automap.ir.lower import lower
    >>> f = lambda x, w, g: jax.lax.ragged_dot(x, w, g)   # 16 rows, 4 groups of [8, 2] weights
    >>> prog = lower(jax.make_jaxpr(f)(jnp.ones((16, 8)), jnp.ones((4, 8, 2)), jnp.full(4, 4)), ["x", "w", "g"], ["y"])
    >>> [dot_flops(prog, prog.ops[0], p) for p in (None, "tpu", "cpu", "gpu")]  # CPU, GPU: a dense dot over all 4
    [512, 512, 2048, 2048]
    """
    traits = traits_of(op.primitive)
    if traits.contraction is None:
        return 0
    if platform == "cpu" and op.primitive == "dot_general" and strength_reduced(context(program, op), **op.params):
        return 0  # a multiply and a reduction on XLA:CPU (its arithmetic stays in op_flops)
    return _flops(program, op, traits, platform)


def op_flops(program: Program, op: Op, platform: str | None = None) -> int:
    """Arithmetic of one execution of ``op`` as ``platform`` compiles it (regions are counted by
    their own ops)."""
    return _flops(program, op, traits_of(op.primitive), platform)


def op_bytes(program: Program, op: Op) -> int:
    """Bytes read and written by one execution (operands plus results), as if nothing were fused."""
    if op.regions:
        return 0
    return sum(program.values[v].nbytes for v in op.inputs + op.outputs)


def fusible(program: Program, op: Op) -> bool:
    """Whether XLA's loop fusion puts ``op`` in one kernel with its elementwise neighbours: its
    traits' ``fusion`` is ``folded`` (relabels and broadcasts), or ``loop`` (elementwise
    arithmetic) with every operand of the result's shape or a scalar. Matmuls, reductions,
    gathers, scatters and loops are kernels of their own.

    >>> import jax, jax.numpy as jnp
    >>> from automap.ir.lower import lower
    >>> prog = lower(jax.make_jaxpr(lambda x, w: jnp.tanh(x @ w).sum())(jnp.ones((4, 8)), jnp.ones((8, 2))),
    ...              ["x", "w"], ["y"])
    >>> [(op.primitive, fusible(prog, op)) for op in prog.all_ops]
    [('dot_general', False), ('tanh', True), ('reduce_sum', False)]
    """
    fusion = traits_of(op.primitive).fusion
    if op.regions or fusion == "kernel":
        return False
    if fusion == "folded":
        return True
    shapes = {program.values[v].shape for v in op.outputs}
    return len(shapes) == 1 and all(program.values[v].shape in shapes or not program.values[v].shape
                                    for v in op.inputs)


def fused_op_bytes(program: Program) -> tuple[int, ...]:
    """Bytes each op reads and writes once XLA has fused elementwise chains (per op of
    ``program.walked``, one execution): a value passed from one fusible op to fusible ops only
    stays in registers; every other value is written once by its producer and read by each
    consumer. ``benchmarks/cost_fidelity.py`` compares it with the ``bytes accessed`` of XLA's
    cost analysis (0.72-1.31 of it for data parallel and Megatron on the zoo models).

    >>> import jax, jax.numpy as jnp
    >>> from automap.ir.lower import lower
    >>> prog = lower(jax.make_jaxpr(lambda x: jnp.exp(x * 2.0) + 1.0)(jnp.ones(256)), ["x"], ["y"])
    >>> sum(fused_op_bytes(prog)), sum(op_bytes(prog, op) for op in prog.all_ops)  # fused: x in, y out
    (2056, 6152)
    """
    got = program.memo.get("fused_op_bytes")
    if got is not None:
        return got
    ops = program.all_ops
    fuses = [fusible(program, op) for op in ops]
    producer: dict[int, int] = {}
    readers: dict[int, list[int]] = {}
    for i, op in enumerate(ops):
        for v in op.outputs:
            producer[v] = i
        for v in op.inputs:
            readers.setdefault(v, []).append(i)
    outputs = set(program.outputs)

    def stored(v: int) -> bool:
        p = producer.get(v)
        if p is None or not fuses[p] or v in outputs:
            return True
        return any(not fuses[r] for r in readers.get(v, ()))

    size = [v.nbytes for v in program.values]
    out = []
    for op, fused in zip(ops, fuses, strict=True):
        if op.regions:
            out.append(0)
        elif not fused:
            out.append(sum(size[v] for v in op.inputs + op.outputs))
        else:
            out.append(sum(size[v] for v in op.inputs + op.outputs if stored(v)))
    got = program.memo["fused_op_bytes"] = tuple(out)
    return got
