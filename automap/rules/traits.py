"""What automap knows of a primitive besides its factor rule: its *traits*, declared next to the rule.

A primitive's :class:`Traits` say what the cost model, emission and the tactics need to know of
it, so that none of them keeps its own list of names:

- ``flops``: the arithmetic of one execution, ``flops(ctx, **params)`` from the op's global
  shapes (the rule's :class:`~automap.rules.registry.RuleContext` and params, like a rule);
  data movement is :func:`no_flops`. ``platform_flops``: where a platform compiles the primitive
  to more (or less) work than its arithmetic, that platform's FLOPs (:meth:`Traits.flops_on`).
- ``fusion``: how XLA's loop fusion treats it (:data:`Fusion`).
- ``memory``: which of its values exist as buffers (:data:`Memory`).
- ``emit``: what emission does around it (:data:`Emit`): pin its results (the anchors of the
  activations' layout), or constrain its operand before it cuts it.
- ``contraction``: for a contraction (``dot_general``, ``conv``), which operand dims it sums
  over and whether the tactics see a matmul (:class:`Contraction`).
- ``lookup``: for an embedding-style lookup (``gather``), which operand is the table and which
  the indices (:class:`Lookup`).
- ``in_place``: it writes its result into its first operand's buffer where that operand has no
  later reader (a scatter, ``dynamic_update_slice``: XLA's buffer assignment shares them).
- ``workspace``: bytes of the temporaries XLA's expansion of the op holds while it runs, besides
  its operands and results, ``workspace(ctx, **params)`` from the global shapes (None: none),
  split per device as its first result is (``workspace_split="operand"``: as its first operand);
  ``platform_workspace``: where a platform expands the primitive otherwise, that platform's.

Traits are declared with the rule: ``register(p, traits=...)`` or a family helper, whose
defaults are the family constants here (``def_elementwise`` gives :data:`ELEMENTWISE`,
``def_reduce`` :data:`REDUCTION`, ...). A contraction-like primitive is one entry::

    @register(ragged_dot_p, traits=contraction(lambda ctx, **_: ((1,), (1,))))
    def _ragged_dot(ctx, **params): ...

A primitive with no declared traits (one whose rule is derived, or registered without traits)
gets :data:`UNKNOWN`: its own kernel, a buffer in and out, one FLOP per result element, never
pinned; ``tests/automap/rules/test_traits.py`` fails on a registered rule without traits.
"""
from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any, Callable, Literal, Sequence

import numpy as np

FlopsFn = Callable[..., int]  # flops(ctx: RuleContext, **params) -> FLOPs of one execution
BytesFn = Callable[..., int]  # workspace(ctx: RuleContext, **params) -> bytes (global shapes)
DimsFn = Callable[..., tuple[tuple[int, ...], ...]]  # dims(ctx, **params) -> contracted dims of each operand

Fusion = Literal["loop", "folded", "kernel"]
"""``loop``: fused with its elementwise neighbours when every operand has the result's shape or is
a scalar; ``folded``: always read in place by the fusion that consumes it (a relabel or a
broadcast); ``kernel``: a kernel of its own (matmuls, reductions, gathers, loops)."""

Memory = Literal["fused", "expensive", "result", "kernel"]
"""``fused``: its result is recomputed in each reader's kernel when they fuse (no buffer);
``expensive``: likewise, but stored when more than one op reads it (a softmax's ``exp``, a
GELU's ``tanh``: XLA does not duplicate it); ``result``: its result is a buffer, its operands are
read inside its fusion (a reduction); ``kernel``: operands read from memory and result a buffer."""

Emit = Literal["replay", "pin", "whole_cut_operand"]
"""``replay``: bound as it is; ``pin``: its results get a sharding constraint under the default
``anchors`` policy (contractions, lookups: they fix the activations' layout); ``whole_cut_operand``:
its operand is constrained with the dims it cuts whole before it runs (slices; see
:meth:`automap.emit._Replay.whole_cut_dims`)."""

ContractionKind = Literal["matmul", "convolution"]


def _numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


def no_flops(ctx: Any, **_: Any) -> int:
    """Data movement: no arithmetic."""
    return 0


def output_elements(ctx: Any, **_: Any) -> int:
    """One FLOP per result element (elementwise work)."""
    return sum(_numel(s.shape) for s in ctx.results)


def input_elements(ctx: Any, **_: Any) -> int:
    """One FLOP per operand element (reductions, scans along a dim)."""
    return sum(_numel(s.shape) for s in ctx.operands)


@dataclasses.dataclass(frozen=True)
class Contraction:
    """A contraction-like primitive: ``dims(ctx, **params)`` gives, for each operand, the dims it
    sums over. A ``matmul`` is what the tactics pair (megatron's column/row matmuls, the flow's
    contraction with a weight), what counts as dot FLOPs, and what XLA turns into a multiply when
    its per-device contraction has size one."""

    dims: DimsFn
    kind: ContractionKind = "matmul"

    def flops(self, ctx: Any, **params: Any) -> int:
        """``2 * |result| * |contraction|``, the contraction's size read off operand 0."""
        lhs_dims = self.dims(ctx, **params)[0]
        return 2 * _numel(ctx.results[0].shape) * math.prod(ctx.operands[0].shape[d] for d in lhs_dims)


@dataclasses.dataclass(frozen=True)
class Lookup:
    """An embedding-style lookup: rows of operand ``table`` picked by operand ``indices``."""

    table: int = 0
    indices: int = 1


@dataclasses.dataclass(frozen=True)
class Traits:
    """What the cost model, emission and the tactics know of one primitive (module docstring)."""

    flops: FlopsFn
    fusion: Fusion
    memory: Memory
    emit: Emit = "replay"
    contraction: Contraction | None = None
    lookup: Lookup | None = None
    in_place: bool = False
    workspace: BytesFn | None = None
    platform_flops: tuple[tuple[str, FlopsFn], ...] = ()  # (platform, flops) where it compiles otherwise
    platform_workspace: tuple[tuple[str, BytesFn], ...] = ()  # (platform, workspace) where it compiles otherwise
    workspace_split: Literal["result", "operand"] = "result"  # split per device as its first result or operand
    # (platform, factor(rule, **params)) where that platform's FLOPs grow with the square of one factor of the op's
    # rule (an expansion over its groups): per device they divide by the factor's split twice (None: no such factor)
    platform_quadratic: tuple[tuple[str, Callable[..., int | None]], ...] = ()
    # XLA's SPMD partitioner runs the op on whole operands (gathered) and slices its results to
    # their shardings: the rule's factors then say only how shardings propagate through it
    runs_whole: bool = False
    # (platform, dtype, wider): that platform computes the op in ``wider`` where its result is
    # ``dtype`` (XLA:CPU upcasts bf16 contractions), so a partial result's sum moves ``wider``
    platform_upcast: tuple[tuple[str, str, str], ...] = ()
    # (platform, dtype): a partial result of ``dtype`` wanted split is all-reduced there, then sliced
    # (measured on XLA:CPU for a bf16 dot, whose kernel runs in f32 and converts back: presumably the
    # convert between the sum and the slice hides the pair from its reduce-scatter creator; a bf16
    # sum's partial result is reduce-scattered)
    platform_unscattered: tuple[tuple[str, str], ...] = ()

    def scatters_partial_on(self, platform: str | None, dtype: Any) -> bool:
        """Whether a partial result of ``dtype`` wanted split is reduce-scattered on ``platform``
        (else all-reduced whole, then sliced).

        >>> import jax.numpy as jnp
        >>> from automap.rules import traits_of
        >>> t = traits_of("dot_general")
        >>> t.scatters_partial_on("cpu", jnp.bfloat16), t.scatters_partial_on("cpu", jnp.float32)
        (False, True)
        """
        return (platform, np.dtype(dtype).name) not in self.platform_unscattered

    def partial_itemsize_on(self, platform: str | None, dtype: Any) -> int:
        """Bytes per element of the op's partial results (summed across devices) on ``platform``.

        >>> import jax.numpy as jnp
        >>> from automap.rules import traits_of
        >>> t = traits_of("dot_general")
        >>> t.partial_itemsize_on("cpu", jnp.bfloat16), t.partial_itemsize_on("gpu", jnp.bfloat16)
        (4, 2)
        """
        dtype = np.dtype(dtype)
        for name, narrow, wider in self.platform_upcast:
            if name == platform and dtype.name == narrow:
                return np.dtype(wider).itemsize
        return dtype.itemsize

    def quadratic_on(self, platform: str | None) -> Callable[..., int | None] | None:
        """The ``platform_quadratic`` factor function of ``platform`` (None: the FLOPs are linear in every
        factor, as the op's own arithmetic is).

        >>> from automap.rules import traits_of
        >>> t = traits_of("conv_general_dilated")  # XLA:CPU expands a batch-grouped conv over its groups
        >>> t.quadratic_on("cpu") is not None, t.quadratic_on("tpu")
        (True, None)
        """
        return next((fn for name, fn in self.platform_quadratic if name == platform), None)

    def __post_init__(self) -> None:
        for field, mode in (("fusion", Fusion), ("memory", Memory), ("emit", Emit)):
            allowed = typing.get_args(mode)
            if getattr(self, field) not in allowed:
                raise ValueError(f"Traits.{field}={getattr(self, field)!r} is not one of {allowed}")
        if not callable(self.flops):
            raise TypeError(f"Traits.flops must be a function flops(ctx, **params) -> int, got {self.flops!r}")

    def flops_on(self, platform: str | None) -> FlopsFn:
        """The FLOPs function of what ``platform`` (``"cpu"``, ``"gpu"``, ``"tpu"``, see
        :attr:`automap.cost.topology.Topology.platform`) compiles: ``flops`` unless
        ``platform_flops`` says otherwise (None: the primitive's own arithmetic).

        >>> t = contraction(lambda ctx, **_: ((1,), (0,)), platform_flops=(("cpu", lambda ctx, **_: 0),))
        >>> t.flops_on("cpu") is t.flops, t.flops_on("tpu") is t.flops, t.flops_on(None) is t.flops
        (False, True, True)
        """
        for name, fn in self.platform_flops:
            if name == platform:
                return fn
        return self.flops

    def workspace_on(self, platform: str | None) -> BytesFn | None:
        """The workspace function of what ``platform`` compiles: ``workspace`` unless
        ``platform_workspace`` says otherwise (as :meth:`flops_on`)."""
        for name, fn in self.platform_workspace:
            if name == platform:
                return fn
        return self.workspace

    @property
    def materializing(self) -> bool:
        """Its results are buffers (XLA does not fuse it into its consumers)."""
        return self.memory in ("result", "kernel")

    @property
    def reads_memory(self) -> bool:
        """It reads its operands from memory (a fusible producer feeding it is stored)."""
        return self.memory == "kernel"

    @property
    def expensive(self) -> bool:
        """An elementwise op not recomputed in several consumers' fusions."""
        return self.memory == "expensive"

    @property
    def pinned(self) -> bool:
        """Emission pins its results under the ``anchors`` policy."""
        return self.emit == "pin"

    @property
    def matmul(self) -> bool:
        return self.contraction is not None and self.contraction.kind == "matmul"


# ---------------------------------------------------------------------------------------------
# family defaults

ELEMENTWISE = Traits(output_elements, "loop", "fused")
EXPENSIVE_ELEMENTWISE = Traits(output_elements, "loop", "expensive")
RELABEL = Traits(no_flops, "folded", "fused")  # reshape, broadcast, convert: read in place
DATA_MOVEMENT = Traits(no_flops, "kernel", "fused")  # copies, transposes, slices
SLICE = dataclasses.replace(DATA_MOVEMENT, emit="whole_cut_operand")
ASSEMBLY = Traits(no_flops, "kernel", "result")  # concatenate, stack, tile: a new buffer from fused operands
# XLA's loop fusion computes a pad inside its readers' kernels, its operand's work with it (a strided
# slice's gradient: the interior-padded halves of ``gate_up[..., ::2]``, ``[..., 1::2]`` added in one fusion)
PAD = Traits(no_flops, "loop", "fused")
UPDATE = Traits(no_flops, "kernel", "kernel", in_place=True)  # in-place updates of a buffer
REDUCTION = Traits(input_elements, "kernel", "result")
# XLA:CPU has no bf16 GEMM, convolution, reduction or scatter-add kernel: it computes them in f32 and converts
# the result after, so a split contraction's or sum's partial results are all-reduced in f32 (twice the bytes)
CPU_BF16_IN_F32 = (("cpu", "bfloat16", "float32"),)
REDUCTION_IN_F32_ON_CPU = dataclasses.replace(REDUCTION, platform_upcast=CPU_BF16_IN_F32)  # sum, max, min
WINDOW_REDUCTION = Traits(input_elements, "kernel", "fused")  # pooling
KERNEL = Traits(input_elements, "kernel", "kernel")  # sorts, cumulative ops, arg reductions


def select_and_scatter_workspace(ctx: Any, **_: Any) -> int:
    """The temporaries of XLA's ``SelectAndScatterExpander`` (run by the CPU and GPU compilers):
    one s32 iota of the operand's shape per dim, and a variadic reduce-window that picks each
    window's winner as its value and its index per dim (source-shaped), which a scatter then
    adds the source into.

    >>> from automap.rules.registry import RuleContext, Shaped
    >>> ctx = RuleContext("select_and_scatter_add", (Shaped((2, 4, 4, 8), "float32"), Shaped((2, 8, 8, 8), "float32")),
    ...                   (Shaped((2, 8, 8, 8), "float32"),))
    >>> select_and_scatter_workspace(ctx)  # 4 iotas of 4 KiB, the winners and their 4 indices, 1 KiB each
    21504
    """
    result = ctx.results[0]
    rank, source = len(result.shape), _numel(ctx.operands[0].shape)
    index = 4  # s32
    return rank * _numel(result.shape) * index + source * (_itemsize(result.dtype) + rank * index)


def _itemsize(dtype: Any) -> int:
    import numpy as np

    return np.dtype(dtype).itemsize


POOLING_GRADIENT = Traits(output_elements, "kernel", "kernel", workspace=select_and_scatter_workspace)
"""``select_and_scatter_add``: the gradient of max pooling, expanded by XLA into a reduce-window
over the operand and its indices and a scatter (:func:`select_and_scatter_workspace`)."""
SCATTER = Traits(output_elements, "kernel", "kernel", in_place=True)
LOOKUP = Traits(no_flops, "kernel", "kernel", emit="pin", lookup=Lookup())
CONTROL_FLOW = Traits(no_flops, "kernel", "kernel")  # regions count their own ops
UNKNOWN = Traits(output_elements, "kernel", "kernel")
"""The sound default for a primitive without declared traits: its own kernel, its operands read
from and its result written to memory, one FLOP per result element, not pinned."""


def contraction(dims: DimsFn, *, kind: ContractionKind = "matmul", flops: FlopsFn | None = None,
                platform_flops: tuple[tuple[str, FlopsFn], ...] = (),
                platform_quadratic: tuple[tuple[str, Callable[..., int | None]], ...] = (),
                platform_upcast: tuple[tuple[str, str, str], ...] = (),
                platform_unscattered: tuple[tuple[str, str], ...] = ()) -> Traits:
    """Traits of a contraction summing over ``dims(ctx, **params)`` of each operand: its own
    kernel, results pinned by emission, FLOPs ``2 * |result| * |contraction|`` unless given
    (``platform_flops``: what some platforms compile instead, :meth:`Traits.flops_on`).

    >>> t = contraction(lambda ctx, **_: ((1,), (0,)))  # x[m, k] @ w[k, n]
    >>> from automap.rules.registry import RuleContext, Shaped
    >>> ctx = RuleContext("toy", (Shaped((4, 8), "f32"), Shaped((8, 2), "f32")), (Shaped((4, 2), "f32"),))
    >>> t.flops(ctx), t.matmul, t.pinned, t.materializing
    (128, True, True, True)
    """
    shape = Contraction(dims, kind)
    return Traits(flops or shape.flops, "kernel", "kernel", emit="pin", contraction=shape,
                  platform_flops=tuple(platform_flops), platform_quadratic=tuple(platform_quadratic),
                  platform_upcast=tuple(platform_upcast), platform_unscattered=tuple(platform_unscattered))


# ---------------------------------------------------------------------------------------------
# the table

TRAITS: dict[str, Traits] = {}


def _name(primitive: Any) -> str:
    return primitive if isinstance(primitive, str) else primitive.name


def declare(*primitives: Any, traits: Traits) -> None:
    """Declare ``traits`` for each primitive (a ``Primitive`` or its name); the last one wins."""
    if not isinstance(traits, Traits):
        raise TypeError(f"traits for {[_name(p) for p in primitives]} must be a Traits, got {traits!r}")
    for p in primitives:
        TRAITS[_name(p)] = traits


def traits_of(primitive: Any) -> Traits:
    """The declared traits of ``primitive``, or :data:`UNKNOWN`.

    >>> traits_of("exp").expensive, traits_of("dot_general").matmul, traits_of("no_such_op") is UNKNOWN
    (True, True, True)
    """
    return TRAITS.get(_name(primitive), UNKNOWN)
