"""Contractions (``dot_general`` is ``b m k, b k n -> b m n`` with ``k`` a reduction factor, conv),
batched linear algebra (batch dims shared, matrix dims whole) and FFTs."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

from automap.rules.conv_windows import (summed_window_dims, swapped_window_ratio, tiled_spatial_dims,
                                        windowed_spatial_dims)
from automap.rules.registry import Factor, FactorRule, RuleContext, einsum, letters, register, replicated
from automap.rules.traits import CPU_BF16_IN_F32, ELEMENTWISE, contraction


def _dot_contracted(ctx: RuleContext, *, dimension_numbers: Any, **_: Any) -> tuple[tuple[int, ...], ...]:
    (lc, rc), _ = dimension_numbers
    return tuple(lc), tuple(rc)


def _conv_contracted(ctx: RuleContext, *, dimension_numbers: Any, **_: Any) -> tuple[tuple[int, ...], ...]:
    """The input features and the window's spatial dims."""
    if dimension_numbers is None:
        return (), ()
    lhs_spec, rhs_spec, _ = dimension_numbers
    return tuple(lhs_spec[1:]), tuple(rhs_spec[1:])


def _conv_flops(ctx: RuleContext, *, dimension_numbers: Any = None, **_: Any) -> int:
    """``2 * |result| * |kernel| / out_features``, the kernel's output-feature dim read off
    ``dimension_numbers`` (HWIO's last dim without them), as XLA counts a convolution."""
    rhs, out = ctx.operands[1].shape, ctx.results[0].shape
    o = dimension_numbers[1][0] if dimension_numbers is not None else len(rhs) - 1
    return 2 * math.prod(out) * math.prod(rhs) // max(rhs[o], 1)




def _dot_terms(lhs_ndim: int, rhs_ndim: int, dimension_numbers: Any, rhs_skip: tuple[int, ...] = ()):
    """Letters of a ``dot_general``'s operands and result: batch, then lhs free, then rhs free
    (``rhs_skip``: rhs dims left out of all three, marked ``"."``)."""
    (lc, rc), (lb, rb) = dimension_numbers
    pool = iter(letters(lhs_ndim + rhs_ndim))
    lterm = [""] * lhs_ndim
    rterm = [""] * rhs_ndim
    for j in rhs_skip:
        rterm[j] = "."
    batch = []
    for i, j in zip(lb, rb, strict=True):
        c = next(pool)
        lterm[i] = rterm[j] = c
        batch.append(c)
    for i, j in zip(lc, rc, strict=True):
        c = next(pool)
        lterm[i] = rterm[j] = c
    lfree = []
    for i in range(lhs_ndim):
        if not lterm[i]:
            lterm[i] = next(pool)
            lfree.append(lterm[i])
    rfree = []
    for j in range(rhs_ndim):
        if not rterm[j]:
            rterm[j] = next(pool)
            rfree.append(rterm[j])
    return lterm, rterm, batch + lfree + rfree


def strength_reduced(ctx: RuleContext, *, dimension_numbers: Any, **_: Any) -> bool:
    """Whether neither operand of a ``dot_general`` has a free dim of more than one element (a
    ``vdot``, ``einsum("ij,ij->i")``): XLA:CPU's algebraic simplifier rewrites such a dot into a
    multiply and a reduction, no dot instruction (:func:`automap.cost.flops.dot_flops`).

    >>> from automap.rules.registry import Shaped
    >>> ctx = RuleContext("dot_general", (Shaped((64,), "f32"), Shaped((64,), "f32")), (Shaped((), "f32"),))
    >>> strength_reduced(ctx, dimension_numbers=(((0,), (0,)), ((), ())))
    True
    """
    (lc, rc), (lb, rb) = dimension_numbers
    lhs, rhs = ctx.operands[:2]
    free = [n for i, n in enumerate(lhs.shape) if i not in lc and i not in lb]
    free += [n for j, n in enumerate(rhs.shape) if j not in rc and j not in rb]
    return all(n == 1 for n in free)


@register("dot_general", traits=contraction(_dot_contracted, platform_upcast=CPU_BF16_IN_F32,
                                            platform_unscattered=(("cpu", "bfloat16"),)))
def _dot_general(ctx: RuleContext, *, dimension_numbers: Any, **_: Any) -> FactorRule:
    lhs, rhs = ctx.operands
    lterm, rterm, out = _dot_terms(lhs.ndim, rhs.ndim, dimension_numbers)
    return einsum(ctx, f"{''.join(lterm)},{''.join(rterm)}->{''.join(out)}")


def _ragged_contracted(ctx: RuleContext, *, ragged_dot_dimension_numbers: Any, **_: Any) -> tuple[tuple[int, ...], ...]:
    (lc, rc), _ = ragged_dot_dimension_numbers.dot_dimension_numbers
    return (tuple(lc), tuple(rc)) + tuple(() for _ in ctx.operands[2:])


def _ragged_flops(ctx: RuleContext, *, ragged_dot_dimension_numbers: Any, **_: Any) -> int:
    """Each row meets one group's weights: ``2 * |lhs| * |rhs free dims|`` (``2 m k n``)."""
    dn = ragged_dot_dimension_numbers
    (_, rc), (_, rb) = dn.dot_dimension_numbers
    rhs = ctx.operands[1].shape
    skip = set(rc) | set(rb) | set(dn.rhs_group_dimensions)
    return 2 * math.prod(ctx.operands[0].shape) * math.prod(n for d, n in enumerate(rhs) if d not in skip)


def _ragged_dense_flops(ctx: RuleContext, *, ragged_dot_dimension_numbers: Any, **params: Any) -> int:
    """A dense dot over every group, ``g`` times :func:`_ragged_flops` (a ragged batch dim is a plain
    dot): what XLA:CPU and XLA:GPU run. JAX 0.10 lowers ``ragged_dot_general`` for CPU as a dot of
    the lhs masked per group (``[g, m, k]``) with the whole rhs; for GPU as ``chlo.ragged_dot``,
    which XLA:GPU's ``RaggedDotRewriter`` expands the same way (its cuDNN grouped GEMM is behind
    the experimental flag ``xla_gpu_experimental_use_ragged_dot_fusion``, off by default). TPU
    runs the ragged dot itself."""
    dn = ragged_dot_dimension_numbers
    (_, _), (lb, _) = dn.dot_dimension_numbers
    groups = 1 if dn.lhs_ragged_dimensions[0] in lb else ctx.operands[2].shape[-1]
    return groups * _ragged_flops(ctx, ragged_dot_dimension_numbers=dn, **params)


def _ragged_dense_workspace(ctx: RuleContext, *, ragged_dot_dimension_numbers: Any, **_: Any) -> int:
    """Bytes of the masked copies the dense expansion of :func:`_ragged_dense_flops` makes: the lhs
    once per group (``[g, m, k]``), and where the ragged dim is contracted (the weight gradient)
    the rhs once per group too; none for a ragged batch dim. Split per device as the lhs.

    >>> import jax
    >>> from automap.rules.registry import RuleContext, Shaped
    >>> dn = jax.lax.RaggedDotDimensionNumbers((([1], [1]), ([], [])), [0], [0])
    >>> ctx = RuleContext("ragged_dot_general", (Shaped((32, 16), "float32"), Shaped((4, 16, 8), "float32"),
    ...                   Shaped((4,), "int32")), (Shaped((32, 8), "float32"),))
    >>> _ragged_dense_workspace(ctx, ragged_dot_dimension_numbers=dn)  # 4 masked copies of the 2 KiB lhs
    8192
    """
    dn = ragged_dot_dimension_numbers
    (lc, _), (lb, _) = dn.dot_dimension_numbers
    ragged = dn.lhs_ragged_dimensions[0]
    if ragged in lb:
        return 0
    lhs, rhs, sizes = ctx.operands[:3]
    groups = sizes.shape[-1]
    expanded = [lhs] + ([rhs] if ragged in lc else [])
    return groups * sum(_nbytes(x) for x in expanded)


def _nbytes(x: Any) -> int:
    import numpy as np

    return math.prod(x.shape) * np.dtype(x.dtype).itemsize


_DENSE_RAGGED = ("cpu", "gpu")  # the platforms that expand a ragged dot into a dense one


@register("ragged_dot_general", traits=dataclasses.replace(contraction(
    _ragged_contracted, flops=_ragged_flops, platform_flops=tuple((p, _ragged_dense_flops) for p in _DENSE_RAGGED)),
    platform_workspace=tuple((p, _ragged_dense_workspace) for p in _DENSE_RAGGED), workspace_split="operand"))
def _ragged_dot_general(ctx: RuleContext, *, ragged_dot_dimension_numbers: Any, **_: Any) -> FactorRule:
    """``lax.ragged_dot`` (mixture of experts): rows of ``lhs`` fall into ``g`` contiguous groups
    of ``group_sizes`` rows. A dot_general otherwise, except:

    - ragged non-contracting lhs dim ``m`` (the forward ``[m,k] x [g,k,n] -> [m,n]``): ``m`` is
      blocked (a shard of rows would need its own group sizes); the rhs group dim ``g`` is a
      reduction (expert parallel: each device multiplies the rows of its experts, zeros elsewhere,
      and the partial results sum); ``k`` a reduction; ``n`` parallel.
    - ragged contracting dim (the weight gradient ``[m,k] x [m,n] -> [g,k,n]``): the ragged dim
      stays whole; the result's group dim is parallel, in no operand (each device computes the
      groups it holds from every row: XLA splits the dense expansion's FLOPs so, 2 all-gathers
      of the group sizes aside); the free dims are parallel.
    - a ragged batch dim: whole.

    ``group_sizes`` stays whole."""
    dn = ragged_dot_dimension_numbers
    lhs, rhs = ctx.operands[:2]
    (lc, _), (lb, _) = dn.dot_dimension_numbers
    (ragged,) = dn.lhs_ragged_dimensions
    groups = tuple(dn.rhs_group_dimensions)
    rest = ["." * s.ndim for s in ctx.operands[2:]]
    if ragged in lb:
        return replicated(ctx)
    lterm, rterm, out = _dot_terms(lhs.ndim, rhs.ndim, dn.dot_dimension_numbers, rhs_skip=groups)
    blocked = lterm[ragged]
    if ragged in lc:
        out = [letters(1, skip="".join(lterm + rterm + out))] + out  # the group dim leads the result
    elif groups:
        g = letters(1, skip="".join(lterm + rterm))
        rterm[groups[0]] = g  # in no result: a reduction
    if len(out) != ctx.results[0].ndim:
        return replicated(ctx)
    return einsum(ctx, ",".join(["".join(lterm), "".join(rterm)] + rest) + f"->{''.join(out)}", blocked=blocked)


def _scaled_contracted(ctx: RuleContext, *, dimension_numbers: Any, **_: Any) -> tuple[tuple[int, ...], ...]:
    (lc, rc), _ = dimension_numbers
    return tuple(lc), tuple(rc), (), ()


@register("scaled_dot", traits=contraction(_scaled_contracted))
def _scaled_dot(ctx: RuleContext, *, dimension_numbers: Any, **_: Any) -> FactorRule:
    """``lax.scaled_dot(lhs, rhs, lhs_scale, rhs_scale)`` (block-scaled low precision): a
    dot_general on lhs and rhs; each scale has its operand's shape with the contracting dims
    divided into blocks, so it shares the batch and free dims and keeps its blocks whole."""
    lhs, rhs, ls, rs = ctx.operands
    lterm, rterm, out = _dot_terms(lhs.ndim, rhs.ndim, dimension_numbers)
    (lc, rc), _ = dimension_numbers

    def scale_term(term: list[str], contracting: Any, value: Any, scale: Any) -> str:
        if scale.ndim != value.ndim:
            return "." * scale.ndim
        return "".join("." if d in contracting or scale.shape[d] != value.shape[d] else c for d, c in enumerate(term))

    terms = ["".join(lterm), "".join(rterm), scale_term(lterm, lc, lhs, ls), scale_term(rterm, rc, rhs, rs)]
    return einsum(ctx, ",".join(terms) + f"->{''.join(out)}")


@register("scaled_matmul_wrapper", traits=contraction(lambda ctx, **_: ((2,), (2,), (), ())))
def _scaled_matmul(ctx: RuleContext, **_: Any) -> FactorRule:
    """``jax.nn.scaled_matmul``: ``[b,m,k] x [b,n,k] -> [b,m,n]`` with scales ``[b,m,k/s]``,
    ``[b,n,k/s]``: ``k`` a reduction, the scale blocks whole."""
    return einsum(ctx, "bmk,bnk,bm.,bn.->bmn")


# a contraction, but its windows make it no matmul for the tactics (and its FLOPs no dot FLOPs)
def _cpu_conv_flops(ctx: RuleContext, *, batch_group_count: int = 1, feature_group_count: int = 1,
                    dimension_numbers: Any = None, **params: Any) -> int:
    """A convolution's FLOPs as XLA:CPU compiles it (:func:`_conv_flops` otherwise):

    - a batch-grouped convolution (a depthwise conv's kernel gradient) is expanded into a dense
      one over all ``G`` groups, keeping the diagonal: ``G`` times the arithmetic, so its FLOPs
      grow with the square of the groups (measured: a 7x7 depthwise kernel gradient over 32
      channels, 401,408 FLOPs of arithmetic, 12,845,056 compiled; with the channels split 4
      ways, 802,816);
    - an ungrouped convolution whose kernel window is larger than its input runs with the
      operands swapped, over the input's elements alone
      (:func:`automap.rules.conv_windows.swapped_window_ratio`): a transposed conv's kernel
      gradient (the window: the output's gradient, the input dilated by the stride; flax
      ``ConvTranspose`` strides 2, 3 and 2x2: 1/2, 1/3, 1/4 of the count with the holes; the
      forward conv, its window smaller than its result, keeps them) and a 3x3 conv over a map
      of 2x2 or 1x1 (a haiku ResNet's last stages: 4/9 and 1/9).

    >>> import jax, jax.numpy as jnp
    >>> from automap.ir.lower import lower
    >>> from automap.cost.flops import dot_flops
    >>> up = lambda x, w: jax.lax.conv_transpose(x, w, (2,), "SAME", dimension_numbers=("NWC", "WIO", "NWC"))
    >>> grad = jax.grad(lambda w, x: up(x, w).sum())
    >>> prog = lower(jax.make_jaxpr(grad)(jnp.ones((2, 8, 4)), jnp.ones((3, 4, 8))), ["w", "x"], ["dw"])
    >>> [(dot_flops(prog, op), dot_flops(prog, op, "cpu")) for op in prog.ops if op.primitive == "conv_general_dilated"]
    [(3072, 1536)]

    (2 x 96 kernel entries x 2 examples x 16 output positions; on XLA:CPU x the 8 input positions.)
    """
    flops = _conv_flops(ctx, dimension_numbers=dimension_numbers, **params) * batch_group_count
    if dimension_numbers is None or batch_group_count != 1 or feature_group_count != 1:
        return flops
    window = {k: params.get(k) for k in ("window_strides", "padding", "lhs_dilation", "rhs_dilation")}
    swapped, kernel = swapped_window_ratio(ctx, dimension_numbers, **window)
    return flops * swapped // kernel


def _batch_groups_factor(rule: FactorRule, *, batch_group_count: int = 1, dimension_numbers: Any = None,
                         **_: Any) -> int | None:
    """The factor of a batch-grouped conv's groups: the first on the lhs batch dim (:func:`_conv`)."""
    if batch_group_count == 1 or dimension_numbers is None or not rule.operands:
        return None
    on_batch = rule.operands[0][dimension_numbers[0][0]]
    return on_batch[0] if on_batch else None


@register("conv_general_dilated", traits=contraction(
    _conv_contracted, kind="convolution", flops=_conv_flops, platform_flops=(("cpu", _cpu_conv_flops),),
    platform_quadratic=(("cpu", _batch_groups_factor),), platform_upcast=CPU_BF16_IN_F32))
def _conv(ctx: RuleContext, *, dimension_numbers: Any, feature_group_count: int = 1,
          batch_group_count: int = 1, window_strides: Sequence[int] = (), padding: Any = (),
          lhs_dilation: Any = None, rhs_dilation: Any = None, **_: Any) -> FactorRule:
    """Batch and output features parallel, input features a reduction, spatial dims whole but
    for the tiled ones (:func:`tiled_spatial_dims`: a patch embedding's, a 1x1 conv's) and the
    windowed ones (:func:`windowed_spatial_dims`: a stride-1 SAME conv's, split with halos; and
    :func:`summed_window_dims`: a kernel gradient's, summed over the split window).

    With ``G = feature_group_count`` groups the feature dims are ``(g, ci)`` (input), ``(g, og)``
    (kernel output and output) and ``ci`` (kernel input). A depthwise conv (``ci == 1``) is
    parallel in its groups ``g``: its channels stay split. XLA partitions no other grouped conv,
    not even along its batch (it gathers the operands), so those stay whole.

    With ``G = batch_group_count`` (a depthwise conv's kernel gradient: the lhs batch dim holds
    the channels, its feature dim the examples) the lhs batch dim is the groups ``g`` (a grouped
    conv's kernel gradient: ``(g, b)``, ``b`` the result's batch), shared with the kernel's and the
    result's output features ``(g, og)``;
    the lhs features and the kernel's input features are the summed examples ``ci``. XLA
    partitions it so (examples split: a partial sum, all-reduced; channels split: no collective).

    >>> import jax, jax.numpy as jnp
    >>> from automap.ir.lower import lower
    >>> dn = jax.lax.ConvDimensionNumbers((3, 0, 1, 2), (3, 0, 1, 2), (2, 3, 0, 1))  # kernel gradient, 16 channels
    >>> f = lambda x, g: jax.lax.conv_general_dilated(x, g, (1, 1), ((1, 1), (1, 1)), dimension_numbers=dn,
    ...                                               batch_group_count=16)
    >>> prog = lower(jax.make_jaxpr(f)(jnp.ones((8, 4, 4, 16)), jnp.ones((8, 4, 4, 16))), ["x", "g"], ["k"])
    >>> rule = prog.ops[0].rule
    >>> [f.kind for f in rule.factors], rule.operands[0], rule.results[0]  # channels parallel, examples summed
    (['parallel', 'reduction'], ((1,), (), (), (0,)), ((), (), (), (0,)))
    """
    if dimension_numbers is None:
        return replicated(ctx)
    lhs_spec, rhs_spec, out_spec = dimension_numbers
    lhs, rhs = ctx.operands
    out = ctx.results[0]
    if batch_group_count != 1:
        if feature_group_count != 1 or lhs.shape[lhs_spec[0]] % batch_group_count:
            return replicated(ctx)
        return _batch_grouped_conv(ctx, dimension_numbers, batch_group_count)
    groups = feature_group_count
    if groups > 1 and rhs.shape[rhs_spec[1]] > 1:
        return replicated(ctx)
    factors: list[Factor] = []

    def factor(size: int, kind: str = "parallel") -> tuple[int, ...]:
        if size == 1:
            return ()
        factors.append(Factor(size, kind))  # type: ignore[arg-type]
        return (len(factors) - 1,)

    b = factor(lhs.shape[lhs_spec[0]])
    g = factor(groups)
    ci = factor(rhs.shape[rhs_spec[1]], "reduction")
    og = factor(rhs.shape[rhs_spec[0]] // groups)
    ldims: list[tuple[int, ...]] = [() for _ in lhs.shape]
    rdims: list[tuple[int, ...]] = [() for _ in rhs.shape]
    odims: list[tuple[int, ...]] = [() for _ in out.shape]
    ldims[lhs_spec[0]] = odims[out_spec[0]] = b
    ldims[lhs_spec[1]] = g + ci
    rdims[rhs_spec[1]] = ci
    rdims[rhs_spec[0]] = odims[out_spec[1]] = g + og
    for i in tiled_spatial_dims(ctx, dimension_numbers, window_strides, padding, lhs_dilation, rhs_dilation):
        position = odims[out_spec[2 + i]] = factor(out.shape[out_spec[2 + i]])
        ldims[lhs_spec[2 + i]] = position + factor(rhs.shape[rhs_spec[2 + i]], "blocked")  # then the offset
    for i in windowed_spatial_dims(ctx, dimension_numbers, window_strides, padding, lhs_dilation, rhs_dilation):
        position = odims[out_spec[2 + i]] = factor(out.shape[out_spec[2 + i]])  # split with halos (automap.conv_halos)
        ldims[lhs_spec[2 + i]] = position + factor(lhs.shape[lhs_spec[2 + i]] // out.shape[out_spec[2 + i]], "blocked")
    for i in summed_window_dims(ctx, dimension_numbers, window_strides, padding, lhs_dilation, rhs_dilation):
        tap = rdims[rhs_spec[2 + i]] = factor(rhs.shape[rhs_spec[2 + i]], "reduction")  # summed, with halos
        ldims[lhs_spec[2 + i]] = tap + factor(lhs.shape[lhs_spec[2 + i]] // rhs.shape[rhs_spec[2 + i]], "blocked")
    # XLA partitions a feature-grouped convolution along its groups first: a kernel split on them
    # splits the input's features to match, the examples left whole where their axes collide
    # (a depthwise kernel's channels on 'data' against the examples on ('data', 'model'): the
    # input gathered whole, 16,896 B sent, the conv split 2 ways, not 8)
    return FactorRule(tuple(factors), (tuple(ldims), tuple(rdims)), (tuple(odims),), leading=g if groups > 1 else ())


def _batch_grouped_conv(ctx: RuleContext, dimension_numbers: Any, groups: int) -> FactorRule:
    """:func:`_conv` with ``batch_group_count == groups`` dividing the lhs batch: factors ``g``
    (lhs batch, outer; kernel and result output features, outer), ``b`` (the lhs batch within a
    group, the result's batch: a grouped conv's kernel gradient, its input features per group;
    none for a depthwise conv's; blocked, as XLA splits it no way), ``ci`` (lhs features, kernel
    input features: summed) and ``og`` (the output features within a group; blocked too where
    ``b`` is: XLA aligns the lhs batch with the kernel's output features, and a split of them
    past the groups aborts it, ``benchmarks/grouped_conv_abort.py``; :mod:`automap.grouped_conv_guard`
    keeps every compiled program to this rule's layout)."""
    lhs_spec, rhs_spec, out_spec = dimension_numbers
    lhs, rhs = ctx.operands
    factors = [Factor(groups, "parallel")]
    g, b, ci, og = (0,), (), (), ()
    if lhs.shape[lhs_spec[0]] // groups > 1:  # jax.jit given a split of it fails XLA's conv partitioner
        factors.append(Factor(lhs.shape[lhs_spec[0]] // groups, "blocked"))
        b = (len(factors) - 1,)
    if lhs.shape[lhs_spec[1]] > 1:
        factors.append(Factor(lhs.shape[lhs_spec[1]], "reduction"))
        ci = (len(factors) - 1,)
    if rhs.shape[rhs_spec[0]] // groups > 1:  # a split past the groups (b > 1) aborts XLA:CPU, as b's
        factors.append(Factor(rhs.shape[rhs_spec[0]] // groups, "blocked" if b else "parallel"))
        og = (len(factors) - 1,)
    ldims: list[tuple[int, ...]] = [() for _ in lhs.shape]
    rdims: list[tuple[int, ...]] = [() for _ in rhs.shape]
    odims: list[tuple[int, ...]] = [() for _ in ctx.results[0].shape]
    ldims[lhs_spec[0]] = g + b
    odims[out_spec[0]] = b
    ldims[lhs_spec[1]] = rdims[rhs_spec[1]] = ci
    rdims[rhs_spec[0]] = odims[out_spec[1]] = g + og
    return FactorRule(tuple(factors), (tuple(ldims), tuple(rdims)), (tuple(odims),))


def _batched(ctx: RuleContext, core: int) -> FactorRule:
    """Leading (batch) dims shared by every operand and result; the ``core`` trailing dims of
    operand 0 (a matrix, a vector) stay whole."""
    nbatch = max(ctx.operands[0].ndim - core, 0)
    batch_shape = ctx.operands[0].shape[:nbatch]
    term = letters(nbatch)

    def value_term(s: Any) -> str:
        if s.shape[:nbatch] != batch_shape:
            return "." * s.ndim
        return term + "." * (s.ndim - nbatch)

    return einsum(ctx, ",".join(map(value_term, ctx.operands)) + "->" + ",".join(map(value_term, ctx.results)))


@register("cholesky", "eig", "eigh", "lu", "qr", "svd", "hessenberg", "schur", "householder_product",
          "tridiagonal", "triangular_solve", "ormqr", traits=ELEMENTWISE)  # costed as elementwise work
def _linalg(ctx: RuleContext, **_: Any) -> FactorRule:
    """Batched matrix decompositions and solves: batch dims shared, matrix dims whole (XLA
    partitions only the batch dims, e.g. not the independent columns of a triangular solve)."""
    return _batched(ctx, 2)


@register("tridiagonal_solve", traits=ELEMENTWISE)
def _tridiagonal_solve(ctx: RuleContext, **_: Any) -> FactorRule:
    return _batched(ctx, 1)  # dl, d, du are (..., m); b is (..., m, n)


@register("fft", traits=dataclasses.replace(ELEMENTWISE, runs_whole=True))
def _fft(ctx: RuleContext, *, fft_lengths: Sequence[int], **_: Any) -> FactorRule:
    """The leading (batch) dims shared, the transformed trailing dims whole. Shardings propagate
    through the batch dims (Shardy's rule), but XLA's SPMD partitioner runs an FFT on its whole
    operand even when only those are sharded (gathered, transformed on every device, the result
    sliced to its sharding): ``runs_whole`` prices that. A replicated rule stopped propagation
    there, and the estimate ran the consumers whole where XLA splits them (a Fourier neural
    operator's spectral einsum, its weight gradient's all-reduce missed: manual_dp bytes sent
    0.39x XLA's)."""
    rank = ctx.operands[0].ndim
    term = letters(rank)
    fft = term[rank - len(fft_lengths):]
    return einsum(ctx, f"{term}->{term}", blocked=fft)
