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
    """Bytes read and written by one execution (operands plus results)."""
    if op.regions:
        return 0
    return sum(program.values[v].nbytes for v in op.inputs + op.outputs)
