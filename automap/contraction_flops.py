"""FLOPs of the contractions in a compiled program, as XLA built them: ``dot`` and
``convolution`` instructions, and the custom-calls by which XLA:GPU hands them to a vendor
library (cuBLAS GEMMs, cuDNN convolutions), whose result is a tuple (the product, a scratch
buffer) and whose contraction is described in their ``backend_config`` or ``dim_labels``.

A convolution's FLOPs are 2 x (forward output elements) x (kernel elements / output features),
whichever of its three forms runs: forward (output = result, kernel = operand 1), the input's
gradient (the forward output's gradient = operand 0, kernel = operand 1) or the kernel's
gradient (the forward output's gradient = operand 1, kernel = result).
"""
from __future__ import annotations

import json
import math
from typing import Callable

from automap import hlo
from automap.hlo import ArrayShape, Instruction

OperandShape = Callable[[int], "hlo.Shape | None"]

_GEMMS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8")
_CONVS = {  # target -> (the forward output, the kernel): an operand index or "result"
    "__cudnn$convForward": ("result", 1),
    "__cudnn$convBiasActivationForward": ("result", 1),
    "__cudnn$convBackwardInput": (0, 1),
    "__cudnn$convBackwardFilter": (1, "result"),
}


def library_target(inst: Instruction) -> str | None:
    """The vendor-library contraction a custom-call runs, or None."""
    if inst.opcode != "custom-call":
        return None
    target = inst.attrs.get("custom_call_target", "").strip('"')
    return target if target in _GEMMS or target in _CONVS else None


def contraction_flops(inst: Instruction, operand_shape: OperandShape) -> int | None:
    """FLOPs of a dot, convolution or library contraction (None where its shapes cannot be read).

    >>> text = '''HloModule m
    ... ENTRY %e (a: f32[64,32], b: f32[32,16]) -> (f32[64,16], s8[8]) {
    ...   %a = f32[64,32]{1,0} parameter(0)
    ...   %b = f32[32,16]{1,0} parameter(1)
    ...   ROOT %g = (f32[64,16]{1,0}, s8[8]{0}) custom-call(%a, %b), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}
    ... }'''
    >>> comp = hlo.parse_module(text).computations["e"]
    >>> contraction_flops(comp.root, lambda i: comp.instructions[comp.root.operands[i]].shape)  # 2 * 64 * 16 * 32
    65536
    """
    result = _first(inst.shape)
    if inst.opcode == "dot":
        lhs = operand_shape(0)
        dims = hlo.int_list(inst.attrs.get("lhs_contracting_dims", "{}"))
        return _dot(result, lhs, dims)
    if inst.opcode == "convolution":
        return _conv(result, operand_shape(1), inst)
    target = library_target(inst)
    if target in _GEMMS:
        try:
            config = json.loads(inst.attrs.get("backend_config", ""))
            dims = [int(d) for d in config["gemm_backend_config"]["dot_dimension_numbers"]["lhs_contracting_dimensions"]]
        except (ValueError, KeyError, TypeError):
            return None
        return _dot(result, operand_shape(0), dims)
    if target in _CONVS:
        out, kernel = (result if k == "result" else _first(operand_shape(k)) for k in _CONVS[target])
        return _conv(out, kernel, inst)
    return None


def _first(shape: "hlo.Shape | None") -> "hlo.Shape | None":
    """A library call's product: the first element of its tuple result."""
    parts = getattr(shape, "parts", None)
    return parts[0] if parts else shape


def _dot(result: "hlo.Shape | None", lhs: "hlo.Shape | None", contracting: list[int]) -> int | None:
    if not isinstance(result, ArrayShape) or not isinstance(lhs, ArrayShape):
        return None
    return 2 * result.elements * math.prod(lhs.dims[d] for d in contracting)


def _conv(out: "hlo.Shape | None", kernel: "hlo.Shape | None", inst: Instruction) -> int | None:
    if not isinstance(out, ArrayShape) or not isinstance(kernel, ArrayShape) or not kernel.dims:
        return None
    labels = inst.attrs.get("dim_labels", "")
    kernel_labels = labels.split("_")[1].split("->")[0] if labels.count("_") >= 1 else ""
    o = kernel_labels.index("o") if "o" in kernel_labels else len(kernel.dims) - 1
    return 2 * out.elements * (kernel.elements // max(kernel.dims[o], 1))
