"""FLOPs and memory traffic of one op, from shapes alone (global, before partitioning)."""
from __future__ import annotations

import math

from automap.ir.program import Op, Program

# ops that move or relabel data without arithmetic
DATA_MOVEMENT = frozenset({
    "broadcast_in_dim", "reshape", "transpose", "squeeze", "expand_dims", "slice", "pad", "concatenate",
    "rev", "split", "dynamic_slice", "dynamic_update_slice", "gather", "copy", "copy_p", "convert_element_type",
    "bitcast_convert_type", "iota", "sharding_constraint", "stop_gradient", "optimization_barrier",
    "random_wrap", "random_unwrap", "random_clone", "device_put", "scan", "cond", "while",
})


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def dot_flops(program: Program, op: Op) -> int:
    """2 * |result| * |contraction| for dot_general; 0 for anything else."""
    if op.primitive != "dot_general":
        return 0
    (lc, _), _ = op.params["dimension_numbers"]
    lhs = program.values[op.inputs[0]].shape
    out = program.values[op.outputs[0]].shape
    return 2 * _numel(out) * math.prod(lhs[d] for d in lc)


def op_flops(program: Program, op: Op) -> int:
    """Arithmetic of one execution of ``op`` (regions are counted by their own ops)."""
    if op.primitive == "dot_general":
        return dot_flops(program, op)
    if op.primitive == "conv_general_dilated":
        rhs = program.values[op.inputs[1]].shape
        out = program.values[op.outputs[0]].shape
        return 2 * _numel(out) * _numel(rhs) // max(rhs[-1], 1)
    if op.primitive in DATA_MOVEMENT:
        return 0
    if op.primitive.startswith("reduce_") or op.primitive.startswith("cum") or op.primitive.startswith("arg"):
        return sum(_numel(program.values[v].shape) for v in op.inputs)
    return sum(_numel(program.values[v].shape) for v in op.outputs)


def op_bytes(program: Program, op: Op) -> int:
    """Bytes read and written by one execution (operands plus results), as if nothing were fused."""
    if op.regions:
        return 0
    return sum(program.values[v].nbytes for v in op.inputs + op.outputs)


# relabels and broadcasts XLA folds into the fusion that reads them (no buffer of their own)
FOLDED = frozenset({"broadcast_in_dim", "convert_element_type", "reshape", "squeeze", "expand_dims", "iota"})
UNFUSED_PREFIXES = ("reduce_", "cum", "arg", "scatter", "gather", "sort", "dynamic_")


def fusible(program: Program, op: Op) -> bool:
    """Whether XLA's loop fusion puts ``op`` in one kernel with its elementwise neighbours:
    elementwise arithmetic (every operand has the result's shape or is a scalar) and the relabels
    in `FOLDED`. Matmuls, reductions, gathers, scatters and loops are kernels of their own.

    >>> import jax, jax.numpy as jnp
    >>> from automap.ir.lower import lower
    >>> prog = lower(jax.make_jaxpr(lambda x, w: jnp.tanh(x @ w).sum())(jnp.ones((4, 8)), jnp.ones((8, 2))),
    ...              ["x", "w"], ["y"])
    >>> [(op.primitive, fusible(prog, op)) for op in prog.all_ops]
    [('dot_general', False), ('tanh', True), ('reduce_sum', False)]
    """
    if op.regions or op.primitive in ("dot_general", "conv_general_dilated"):
        return False
    if op.primitive in FOLDED:
        return True
    if op.primitive in DATA_MOVEMENT or op.primitive.startswith(UNFUSED_PREFIXES):
        return False
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
