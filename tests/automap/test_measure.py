"""automap.measure: HLO parsing on hand-written snippets, then real programs on 8 CPU devices."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from automap import hlo
from automap.measure import CollectiveOp, CollectiveStat, Measurement, MemoryStat, measure

ADD = """
%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}
"""


def module(body: str, *, partitions: int = 4, extra: str = "") -> str:
    """An HLO module whose ENTRY takes %p: f32[8,16] and %v: f32[8]."""
    return f"""HloModule test, entry_computation_layout={{(f32[8,16]{{1,0}})->f32[]}}, num_partitions={partitions}
{ADD}
{extra}
ENTRY %main.1_spmd (p: f32[8,16], v: f32[8]) -> f32[8,16] {{
  %p = f32[8,16]{{1,0}} parameter(0), sharding={{devices=[4,1]<=[4]}}, metadata={{op_name="x"}}
  %v = f32[8]{{0}} parameter(1)
{body}
}}
"""


def stats(m: Measurement) -> dict[str, tuple[int, int]]:
    return {kind: (s.count, s.bytes) for kind, s in m.collectives.items()}


# ---------------------------------------------------------------------------- shapes

@pytest.mark.parametrize("text, nbytes", [
    ("f32[8,16]{1,0}", 512),
    ("pred[3]", 3),
    ("bf16[2,2]{1,0:T(2,128)(2,1)}", 8),
    ("s4[3]{0}", 2),  # sub-byte: rounded up per buffer
    ("f8e4m3fn[10]", 10),
    ("f32[<=8,2]", 64),  # bounded dynamic dim: its bound
    ("f32[]", 4),
    ("(f32[8,16]{1,0}, s32[], /*index=2*/(u8[4], c64[2]))", 512 + 4 + 4 + 16),
    ("()", 0),
])
def test_parse_shape_bytes(text, nbytes):
    assert hlo.parse_shape(text).nbytes == nbytes


@pytest.mark.parametrize("text", ["f32[?,8]", "q32[4]", "f32[8"])
def test_parse_shape_rejects(text):
    with pytest.raises(ValueError):
        hlo.parse_shape(text)


# ---------------------------------------------------------------------------- kinds and bytes

KINDS_HLO = module("""
  %ar = f32[8,16]{1,0} all-reduce(%p), channel_id=1, replica_groups={{0,1,2,3}}, to_apply=%add
  %ag = f32[32,16]{1,0} all-gather(%ar), channel_id=2, replica_groups={{0,1,2,3}}, dimensions={0}
  %rs = f32[2,16]{1,0} reduce-scatter(%ag), channel_id=3, replica_groups={{0,1,2,3}}, dimensions={0}, to_apply=%add
  %a2a = f32[8,16]{1,0} all-to-all(%p), channel_id=4, replica_groups={{0,1,2,3}}, dimensions={0}
  ROOT %cp = f32[8,16]{1,0} collective-permute(%a2a), channel_id=5, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
""")

ASYNC_HLO = module("""
  %ars = f32[8]{0} all-reduce-start(%v), channel_id=1, replica_groups={}, to_apply=%add
  %ard = f32[8]{0} all-reduce-done(%ars)
  %ags = (f32[8]{0}, f32[32]{0}) all-gather-start(%ard), channel_id=2, replica_groups=[1,4]<=[4], dimensions={0}
  %agd = f32[32]{0} all-gather-done(%ags)
  %cps = (f32[32]{0}, f32[32]{0}, u32[], u32[]) collective-permute-start(%agd), channel_id=3, source_target_pairs={{0,1},{1,0}}
  %cpd = f32[32]{0} collective-permute-done(%cps)
  %st = ((f32[32]{0}), f32[8]{0}, s32[]) async-start(%cpd), calls=%wrapped_rs
  ROOT %dn = f32[8]{0} async-done(%st), calls=%wrapped_rs
""", extra="""
%wrapped_rs (x: f32[32]) -> f32[8] {
  %x = f32[32]{0} parameter(0)
  ROOT %rs = f32[8]{0} reduce-scatter(%x), channel_id=4, replica_groups={{0,1,2,3}}, dimensions={0}, to_apply=%add
}
""")

TUPLE_HLO = module("""
  %q = bf16[4,4]{1,0} convert(%p)
  ROOT %ar = (f32[8,16]{1,0}, f32[8]{0}, bf16[4,4]{1,0}) all-reduce(%p, %v, %q), replica_groups={}, to_apply=%add
""")

# operands spelled with their shapes (older printers); reduce-scatter sizes from them
INLINE_HLO = module("""
  ROOT %rs = f32[2,16]{1,0} reduce-scatter(f32[8,16]{1,0} %p), replica_groups={{0,1,2,3}}, dimensions={0}, to_apply=%add
""")

NESTED_WHILE_HLO = module("""
  %zero = s32[] constant(0)
  %init = (s32[], f32[8]{0}) tuple(%zero, %v)
  %loop = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%outer, backend_config={"known_induction_variable":{"tuple_index":"0"},"known_trip_count":{"n":"5"}}
  ROOT %out = f32[8]{0} get-tuple-element(%loop), index=1
""", extra="""
%cond (t: (s32[], f32[8])) -> pred[] {
  %t = (s32[], f32[8]{0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

%inner (t.1: (s32[], f32[8])) -> (s32[], f32[8]) {
  %t.1 = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t.1), index=0
  %x = f32[8]{0} get-tuple-element(%t.1), index=1
  %ar = f32[8]{0} all-reduce(%x), replica_groups={}, to_apply=%add
  ROOT %r = (s32[], f32[8]{0}) tuple(%i, %ar)
}

%outer (t.2: (s32[], f32[8])) -> (s32[], f32[8]) {
  %t.2 = (s32[], f32[8]{0}) parameter(0)
  %w = (s32[], f32[8]{0}) while(%t.2), condition=%cond, body=%inner, backend_config={"known_trip_count":{"n":"3"}}
  %y = f32[8]{0} get-tuple-element(%w), index=1
  %ag = f32[32]{0} all-gather(%y), replica_groups={}, dimensions={0}
  %i.2 = s32[] get-tuple-element(%w), index=0
  ROOT %r.2 = (s32[], f32[8]{0}) tuple(%i.2, %y)
}
""")

UNKNOWN_TRIP_HLO = NESTED_WHILE_HLO.replace(',"known_trip_count":{"n":"5"}', "")

CALLS_HLO = module("""
  %f = f32[8]{0} fusion(%v), kind=kLoop, calls=%fused
  %c = f32[32]{0} call(%f), to_apply=%callee
  %pred = pred[] constant(false)
  %cond = f32[8]{0} conditional(%pred, %v, %v), branch_computations={%branch0, %branch1}
  ROOT %r = f32[8]{0} reduce(%v, %zero), dimensions={0}, to_apply=%add_with_collective
""", extra="""
%fused (p0: f32[8]) -> f32[8] {
  %p0 = f32[8]{0} parameter(0)
  ROOT %ar.f = f32[8]{0} all-reduce(%p0), replica_groups={}, to_apply=%add
}

%callee (p1: f32[8]) -> f32[32] {
  %p1 = f32[8]{0} parameter(0)
  ROOT %ag.c = f32[32]{0} all-gather(%p1), replica_groups={}, dimensions={0}
}

%branch0 (b0: f32[8]) -> f32[8] {
  %b0 = f32[8]{0} parameter(0)
  ROOT %cp.0 = f32[8]{0} collective-permute(%b0), source_target_pairs={{0,1}}
}

%branch1 (b1: f32[8]) -> f32[8] {
  %b1 = f32[8]{0} parameter(0)
  ROOT %cp.1 = f32[8]{0} collective-permute(%b1), source_target_pairs={{1,0}}
}

%add_with_collective (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  %ar.r = f32[] all-reduce(%x), replica_groups={}, to_apply=%add
  ROOT %s.r = f32[] add(%ar.r, %y)
}

%unreachable (u: f32[8]) -> f32[32] {
  %u = f32[8]{0} parameter(0)
  ROOT %ag.u = f32[32]{0} all-gather(%u), replica_groups={}, dimensions={0}
}
""")


@pytest.mark.parametrize("name, text, expected", [
    ("one of each kind", KINDS_HLO, {"all-reduce": (1, 512), "all-gather": (1, 2048),
                                     "reduce-scatter": (1, 2048), "all-to-all": (1, 512),
                                     "collective-permute": (1, 512)}),
    ("async pairs once", ASYNC_HLO, {"all-reduce": (1, 32), "all-gather": (1, 128),
                                     "reduce-scatter": (1, 128), "collective-permute": (1, 128)}),
    ("tuple summed", TUPLE_HLO, {"all-reduce": (1, 512 + 32 + 32)}),
    ("inline operand shapes", INLINE_HLO, {"reduce-scatter": (1, 512)}),
    ("nested whiles multiply", NESTED_WHILE_HLO, {"all-reduce": (15, 15 * 32),
                                                  "all-gather": (5, 5 * 128)}),
    ("unknown trip count once", UNKNOWN_TRIP_HLO, {"all-reduce": (3, 3 * 32),
                                                   "all-gather": (1, 128)}),
    ("calls, fusions, branches; no reducers", CALLS_HLO, {
        "all-reduce": (1, 32), "all-gather": (1, 128), "collective-permute": (2, 64)}),
])
def test_collectives(name, text, expected):
    m = measure(text)
    assert stats(m) == expected, name
    assert m.collective_bytes == sum(b for _, b in expected.values())
    assert m.memory is None and m.memory_per_device is None


def test_ops_record_where_and_how_often():
    m = measure(NESTED_WHILE_HLO)
    ar, ag = sorted(m.ops, key=lambda op: op.kind)[::-1]
    assert ar == CollectiveOp("all-reduce", 32, 15, [[0, 1, 2, 3]], "ar", "inner",
                              opcode="all-reduce", group_size=4)
    assert ar.wire_bytes == 15 * 32 * 2 * 3 / 4  # 15 executions of a ring all-reduce over 4
    assert (ag.kind, ag.count_multiplier, ag.computation, ag.total_bytes) == \
        ("all-gather", 5, "outer", 640)
    assert m.warnings == ()
    assert measure(UNKNOWN_TRIP_HLO).warnings  # says the loop was counted once
    cp = [op for op in measure(KINDS_HLO).ops if op.kind == "collective-permute"][0]
    assert cp.replica_groups is None and cp.source_target_pairs == [[0, 1], [1, 2], [2, 3], [3, 0]]


# ---------------------------------------------------------------------------- replica groups

@pytest.mark.parametrize("syntax, groups", [
    ("{{0,1},{2,3},{4,5},{6,7}}", [[0, 1], [2, 3], [4, 5], [6, 7]]),
    ("{}", [list(range(8))]),
    ("[2,4]<=[8]", [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("[4,2]<=[2,4]T(1,0)", [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("[2,4]<=[4,2]T(1,0)", [[0, 2, 4, 6], [1, 3, 5, 7]]),
    ("mesh['axis_0'=8,'axis_1'=1] {'axis_0'}", [list(range(8))]),
    ("mesh['axis_0'=1,'axis_1'=2,'axis_2'=4] {'axis_1'}", [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_1'}",
     [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("mesh['a'=2,'b'=4], device_ids=(7,6,5,4,3,2,1,0) {'b'}", [[7, 6, 5, 4], [3, 2, 1, 0]]),
    ("mesh['a'=2,'b'=4] {'b','a'}", [[0, 4, 1, 5, 2, 6, 3, 7]]),
    ("mesh['a'=8] {'a':(1)2}", [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("mesh['a'=8] {'a':(2)4}", [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("mesh['a'=2,'b'=4] {'a','b':(2)2}", [[0, 1, 4, 5], [2, 3, 6, 7]]),
])
def test_replica_groups(syntax, groups):
    text = module(f"  ROOT %ar = f32[8]{{0}} all-reduce(%v), replica_groups={syntax}, "
                  "use_global_device_ids=true, to_apply=%add", partitions=8)
    (op,) = measure(text).ops
    assert op.replica_groups == groups


# ---------------------------------------------------------------------------- XLA:CPU reduce-scatter

SLICE_FUSION = """
%slice_fusion (param_0: f32[8,16], param_1: u32[]) -> f32[2,16] {
  %param_0 = f32[8,16]{1,0} parameter(0)
  %param_1 = u32[] parameter(1)
  %cv = s32[] convert(%param_1)
  %c2 = s32[] constant(2)
  %off = s32[] multiply(%cv, %c2)
  %z = s32[] constant(0)
  ROOT %ds = f32[2,16]{1,0} dynamic-slice(%param_0, %off, %z), dynamic_slice_sizes={2,16}
}
"""


@pytest.mark.parametrize("name, body, kind", [
    ("fused slice at partition-id * 2", """
  %pid = u32[] partition-id()
  %ar = f32[8,16]{1,0} all-reduce(%p), channel_id=1, replica_groups=[1,4]<=[4], use_global_device_ids=true, to_apply=%add
  ROOT %out = f32[2,16]{1,0} fusion(%ar, %pid), kind=kLoop, calls=%slice_fusion""", "reduce-scatter"),
    ("table lookup behind a bitcast", """
  %table = s32[4]{0} constant({0, 1, 2, 3})
  %pid = u32[] partition-id()
  %entry = s32[1]{0} dynamic-slice(%table, %pid), dynamic_slice_sizes={1}
  %off = s32[] reshape(%entry)
  %z = s32[] constant(0)
  %ar = f32[8,16]{1,0} all-reduce(%p), replica_groups={{0,1,2,3}}, to_apply=%add
  %bc = f32[4,2,16]{2,1,0} bitcast(%ar)
  ROOT %ds = f32[1,2,16]{2,1,0} dynamic-slice(%bc, %off, %z, %z), dynamic_slice_sizes={1,2,16}""",
     "reduce-scatter"),
    ("also used whole", """
  %pid = u32[] partition-id()
  %ar = f32[8,16]{1,0} all-reduce(%p), replica_groups={{0,1,2,3}}, to_apply=%add
  %out = f32[2,16]{1,0} fusion(%ar, %pid), kind=kLoop, calls=%slice_fusion
  ROOT %t = (f32[2,16]{1,0}, f32[8,16]{1,0}) tuple(%out, %ar)""", "all-reduce"),
    ("offset not per partition", """
  %c = u32[] constant(1)
  %ar = f32[8,16]{1,0} all-reduce(%p), replica_groups={{0,1,2,3}}, to_apply=%add
  ROOT %out = f32[2,16]{1,0} fusion(%ar, %c), kind=kLoop, calls=%slice_fusion""", "all-reduce"),
    ("slice does not match the group", """
  %pid = u32[] partition-id()
  %ar = f32[8,16]{1,0} all-reduce(%p), replica_groups={{0,1},{2,3}}, to_apply=%add
  ROOT %out = f32[2,16]{1,0} fusion(%ar, %pid), kind=kLoop, calls=%slice_fusion""", "all-reduce"),
])
def test_all_reduce_then_slice(name, body, kind):
    (op,) = measure(module(body, extra=SLICE_FUSION)).ops
    assert (op.kind, op.bytes, op.opcode) == (kind, 512, "all-reduce"), name


@pytest.mark.parametrize("name, body, expected", [
    ("combined all-reduce, one element scattered", """
  %pid = u32[] partition-id()
  %ar = (f32[8,16]{1,0}, f32[8]{0}) all-reduce(%p, %v), replica_groups={{0,1,2,3}}, to_apply=%add
  %g0 = f32[8,16]{1,0} get-tuple-element(%ar), index=0
  %g1 = f32[8]{0} get-tuple-element(%ar), index=1
  %s = f32[2,16]{1,0} fusion(%g0, %pid), kind=kLoop, calls=%slice_fusion
  ROOT %t = (f32[2,16]{1,0}, f32[8]{0}) tuple(%s, %g1)""",
     {"reduce-scatter": (1, 512), "all-reduce": (1, 32)}),
    ("combined all-reduce used whole", """
  %ar = (f32[8,16]{1,0}, f32[8]{0}) all-reduce(%p, %v), replica_groups={{0,1,2,3}}, to_apply=%add
  ROOT %t = (f32[8,16]{1,0}, f32[8]{0}) tuple(%ar)""", {"all-reduce": (1, 544)}),
    ("async all-reduce then slice", """
  %pid = u32[] partition-id()
  %ars = f32[8,16]{1,0} all-reduce-start(%p), replica_groups={{0,1,2,3}}, to_apply=%add
  %ard = f32[8,16]{1,0} all-reduce-done(%ars)
  ROOT %out = f32[2,16]{1,0} fusion(%ard, %pid), kind=kLoop, calls=%slice_fusion""",
     {"reduce-scatter": (1, 512)}),
])
def test_all_reduce_then_slice_variants(name, body, expected):
    assert stats(measure(module(body, extra=SLICE_FUSION))) == expected, name


def test_all_reduce_then_slice_through_loop_carry():
    # the slice offset is computed from partition-id outside the loop and carried in
    text = module("""
  %pid = u32[] partition-id()
  %zero = s32[] constant(0)
  %init = (s32[], f32[8,16]{1,0}, u32[]) tuple(%zero, %p, %pid)
  %loop = (s32[], f32[8,16]{1,0}, u32[]) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  ROOT %out = f32[8,16]{1,0} get-tuple-element(%loop), index=1""", extra=SLICE_FUSION + """
%cond (t: (s32[], f32[8,16], u32[])) -> pred[] {
  %t = (s32[], f32[8,16]{1,0}, u32[]) parameter(0)
  ROOT %c = pred[] constant(true)
}

%body (t.1: (s32[], f32[8,16], u32[])) -> (s32[], f32[8,16], u32[]) {
  %t.1 = (s32[], f32[8,16]{1,0}, u32[]) parameter(0)
  %i = s32[] get-tuple-element(%t.1), index=0
  %x = f32[8,16]{1,0} get-tuple-element(%t.1), index=1
  %id = u32[] get-tuple-element(%t.1), index=2
  %ar = f32[8,16]{1,0} all-reduce(%x), replica_groups={}, to_apply=%add
  %s = f32[2,16]{1,0} fusion(%ar, %id), kind=kLoop, calls=%slice_fusion
  %x.1 = f32[8,16]{1,0} pad(%s, %i), padding=0_6x0_0
  ROOT %r = (s32[], f32[8,16]{1,0}, u32[]) tuple(%i, %x.1, %id)
}
""")
    assert stats(measure(text)) == {"reduce-scatter": (4, 4 * 512)}


# ---------------------------------------------------------------------------- dot FLOPs

FLOPS_HLO = module("""
  %zero = s32[] constant(0)
  %a = f32[8,16]{1,0} copy(%p)
  %init = (s32[], f32[8,16]{1,0}) tuple(%zero, %a)
  %loop = (s32[], f32[8,16]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"6"}}
  %bd = f32[4,8,32]{2,1,0} fusion(%p), kind=kOutput, calls=%batched
  %img = f32[1,8,8,16]{3,2,1,0} constant({...})
  %k = f32[3,3,16,32]{3,2,1,0} constant({...})
  ROOT %conv = f32[1,8,8,32]{3,2,1,0} convolution(%img, %k), window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_01io->b01f
""", extra="""
%cond (t: (s32[], f32[8,16])) -> pred[] {
  %t = (s32[], f32[8,16]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

%body (t.1: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %t.1 = (s32[], f32[8,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t.1), index=0
  %x = f32[8,16]{1,0} get-tuple-element(%t.1), index=1
  %w = f32[16,32]{1,0} constant({...})
  %d = f32[8,32]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %y = f32[8,16]{1,0} slice(%d), slice={[0:8], [0:16]}
  ROOT %r = (s32[], f32[8,16]{1,0}) tuple(%i, %y)
}

%batched (q: f32[8,16]) -> f32[4,8,32] {
  %q = f32[8,16]{1,0} parameter(0)
  %l = f32[4,8,16]{2,1,0} broadcast(%q), dimensions={1,2}
  %r = f32[4,16,32]{2,1,0} constant({...})
  ROOT %bd = f32[4,8,32]{2,1,0} dot(f32[4,8,16]{2,1,0} %l, %r), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}
}
""")


def test_dot_flops():
    loop = 6 * 2 * 8 * 32 * 16
    batched = 2 * 4 * 8 * 32 * 16
    conv = 2 * (8 * 8 * 32) * (3 * 3 * 16)
    assert measure(FLOPS_HLO).dot_flops == loop + batched + conv


# XLA:GPU (jax 0.11.2, one H100) hands contractions to cuBLAS and cuDNN as custom-calls whose
# result is (product, scratch); lines as it compiled them, metadata and most of backend_config cut
GPU_LIBRARY_HLO = """HloModule jit_train_step, is_scheduled=true

ENTRY %main (x: f32[8192,768], w: f32[768,2304], b: f32[768], q: f32[96,1024,64], k: f32[96,64,1024], img: f32[8,32,32,16], kern: f32[3,3,16,32], dy: f32[8,32,32,32], bias: f32[32]) -> f32[] {
  %x = f32[8192,768]{1,0} parameter(0)
  %w = f32[768,2304]{1,0} parameter(1)
  %b = f32[768]{0} parameter(2)
  %q = f32[96,1024,64]{2,1,0} parameter(3)
  %k = f32[96,64,1024]{2,1,0} parameter(4)
  %img = f32[8,32,32,16]{3,2,1,0} parameter(5)
  %kern = f32[32,3,3,16]{3,2,1,0} parameter(6)
  %dy = f32[8,32,32,32]{3,2,1,0} parameter(7)
  %bias = f32[32]{0} parameter(8)
  %custom-call.13 = (f32[8192,2304]{1,0}, s8[33554432]{0}) custom-call(%x, %w), custom_call_target="__cublas$lt$matmul", backend_config={"device_type":"DEVICE_TYPE_INVALID","gemm_backend_config":{"alpha_real":1,"beta":0,"dot_dimension_numbers":{"lhs_batch_dimensions":[],"lhs_contracting_dimensions":["1"],"rhs_batch_dimensions":[],"rhs_contracting_dimensions":["0"]},"epilogue":"DEFAULT"}}
  %custom-call.5 = (f32[96,1024,1024]{2,1,0}, s8[33554432]{0}) custom-call(%q, %k), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"alpha_real":0.125,"dot_dimension_numbers":{"lhs_batch_dimensions":["0"],"lhs_contracting_dimensions":["2"],"rhs_batch_dimensions":["0"],"rhs_contracting_dimensions":["1"]}}}
  %cudnn-conv-bias-activation.1 = (f32[8,32,32,32]{3,2,1,0}, u8[0]{0}) custom-call(%img, %kern, %bias), window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_o01i->b01f, custom_call_target="__cudnn$convBiasActivationForward", backend_config={"cudnn_conv_backend_config":{"activation_mode":"kNone"}}
  %cudnn-conv-bw-input.1 = (f32[8,32,32,16]{3,2,1,0}, u8[0]{0}) custom-call(%dy, %kern), window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_o01i->b01f, custom_call_target="__cudnn$convBackwardInput", backend_config={"cudnn_conv_backend_config":{"activation_mode":"kNone"}}
  %cudnn-conv-bw-filter.1 = (f32[32,3,3,16]{3,2,1,0}, u8[2089663]{0}) custom-call(%img, %dy), window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_o01i->b01f, custom_call_target="__cudnn$convBackwardFilter", backend_config={"cudnn_conv_backend_config":{"activation_mode":"kNone"}}
  %other = (f32[8]{0}, s8[4]{0}) custom-call(%b), custom_call_target="SomethingElse"
  ROOT %r = f32[] constant(0)
}
"""


def test_library_contractions_on_gpu_are_dot_flops():
    qkv = 2 * 8192 * 2304 * 768
    scores = 2 * 96 * 1024 * 1024 * 64
    conv = 2 * (8 * 32 * 32 * 32) * (3 * 3 * 16)  # each of the three forms: the forward's FLOPs
    m = measure(GPU_LIBRARY_HLO)
    assert m.dot_flops == qkv + scores + 3 * conv and m.warnings == ()


# ---------------------------------------------------------------------------- errors

def test_unparseable_collective_shape_names_the_line():
    text = module("  ROOT %bad = f32[?,16]{1,0} all-reduce(%p), replica_groups={}, to_apply=%add")
    with pytest.raises(ValueError, match=r"%bad = f32\[\?,16\]"):
        measure(text)


def test_unknown_lines_are_skipped():
    text = module("""
  this line is not HLO at all
  %odd = zork[2] frobnicate(%p), flavour=strange
  %ag = f32[32,16]{1,0} all-gather(%p), replica_groups={}, dimensions={0}
  ROOT %t = (f32[32,16]{1,0}) tuple(%ag)""")
    assert stats(measure(text)) == {"all-gather": (1, 2048)}


def test_a_text_measured_again_is_not_parsed_again(monkeypatch):
    """The arbiter measures a program, its caller the same executable again (JAX's compile cache):
    one parse per text, and each caller gets its own Measurement to keep."""
    from automap.measure import _measure_text

    _measure_text.cache_clear()
    parsed = []
    real = hlo.parse_module
    monkeypatch.setattr(hlo, "parse_module", lambda text: parsed.append(text) or real(text))
    text = module("  ROOT %ag = f32[32,16]{1,0} all-gather(%p), replica_groups={}, dimensions={0}  /* again */")
    first, again = measure(text), measure(text)
    assert len(parsed) == 1 and stats(first) == stats(again) == {"all-gather": (1, 2048)}
    assert first.ops == again.ops and first.ops is not again.ops and first.collectives is not again.collectives


def test_rejects_lowered():
    lowered = jax.jit(lambda x: x + 1).lower(jnp.ones(3))
    with pytest.raises(TypeError, match="compile"):
        measure(lowered)


# ---------------------------------------------------------------------------- real programs

@pytest.fixture(scope="module")
def mesh():
    assert jax.device_count() == 8, "tests/conftest.py must set XLA_FLAGS before JAX starts"
    return jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))


def _compile(mesh, fn, in_specs, out_spec, *shapes):
    s = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
    args = [jax.ShapeDtypeStruct(sh, jnp.float32) for sh in shapes]
    return jax.jit(fn, in_shardings=tuple(s(sp) for sp in in_specs),
                   out_shardings=s(out_spec)).lower(*args).compile()


def _scan_matmul(x, ws):
    def step(c, w):
        return c + x @ w, None
    return jax.lax.scan(step, jnp.zeros((16, 64)), ws)[0]


def _shard_map(mesh, fn, in_spec, out_spec):
    return jax.shard_map(fn, mesh=mesh, in_specs=in_spec, out_specs=out_spec)


# (name, fn, in specs, out spec, arg shapes, {kind: (count, bytes)}, dot flops)
REAL = [
    ("contraction sharded, result replicated: all-reduce of the result",
     lambda x, w: x @ w, (P(None, "x"), P("x", None)), P(), [(16, 32), (32, 64)],
     {"all-reduce": (1, 16 * 64 * 4)}, 2 * 16 * 64 * 4),
    ("contraction sharded, result sharded: reduce-scatter (all-reduce + slice on CPU)",
     lambda x, w: x @ w, (P(None, "x"), P("x", None)), P("x", None), [(16, 32), (32, 64)],
     {"reduce-scatter": (1, 16 * 64 * 4)}, 2 * 16 * 64 * 4),
    ("sharded operand, replicated result: all-gather of the gathered bytes",
     lambda x: x * 2, (P("x", None),), P(), [(16, 32)],
     {"all-gather": (1, 16 * 32 * 4)}, 0),
    ("scan of 4 sharded-contraction matmuls: 4 all-reduces",
     _scan_matmul, (P(None, "x"), P(None, "x", None)), P(), [(16, 32), (4, 32, 64)],
     {"all-reduce": (4, 4 * 16 * 64 * 4)}, 4 * 2 * 16 * 64 * 4),
]


@pytest.mark.parametrize("name, fn, in_specs, out_spec, shapes, expected, flops", REAL)
def test_real_programs(mesh, name, fn, in_specs, out_spec, shapes, expected, flops):
    compiled = _compile(mesh, fn, in_specs, out_spec, *shapes)
    m = measure(compiled)
    assert stats(m) == expected, name
    assert m.dot_flops == flops, name
    assert all(op.replica_groups == [list(range(8))] for op in m.ops)
    mem = compiled.memory_analysis()
    assert m.memory == MemoryStat(mem.argument_size_in_bytes, mem.output_size_in_bytes,
                                  mem.alias_size_in_bytes, mem.temp_size_in_bytes)
    assert m.memory_per_device == (mem.argument_size_in_bytes + mem.output_size_in_bytes
                                   - mem.alias_size_in_bytes + mem.temp_size_in_bytes)
    assert stats(measure(compiled.as_text())) == expected  # text in, same collectives


def _scan_compiled(mesh):
    _, fn, in_specs, out_spec, shapes, _, _ = REAL[3]
    return _compile(mesh, fn, in_specs, out_spec, *shapes)


def test_scan_flops_exceed_cost_analysis(mesh):
    compiled = _scan_compiled(mesh)
    assert measure(compiled).dot_flops > compiled.cost_analysis()["flops"]  # body counted once


@pytest.mark.parametrize("name, fn, in_spec, out_spec, expected", [
    ("ppermute", lambda a: jax.lax.ppermute(a, "x", [(i, (i + 1) % 8) for i in range(8)]),
     P("x"), P("x"), {"collective-permute": (1, 2 * 32 * 4)}),
    ("all_to_all", lambda a: jax.lax.all_to_all(a, "x", 1, 0, tiled=True),
     P("x"), P("x"), {"all-to-all": (1, 2 * 32 * 4)}),
    ("psum_scatter", lambda a: jax.lax.psum_scatter(a, "x", scatter_dimension=0, tiled=True),
     P(), P("x"), {"reduce-scatter": (1, 16 * 32 * 4)}),
])
def test_real_shard_map(mesh, name, fn, in_spec, out_spec, expected):
    f = jax.jit(_shard_map(mesh, fn, in_spec, out_spec))
    m = measure(f.lower(jax.ShapeDtypeStruct((16, 32), jnp.float32)).compile())
    assert stats(m) == expected, name


def test_real_fsdp_gradients_are_reduce_scattered(mesh):
    # XLA:CPU combines the two gradients of a layer into one tuple all-reduce, each element
    # then sliced per partition: a reduce-scatter of both, once per scanned layer
    def loss(params, x):
        def layer(h, p):
            w1, w2 = p
            return h + jax.nn.relu(h @ w1) @ w2, None
        return jnp.mean(jax.lax.scan(layer, x, params)[0] ** 2)

    def step(params, x):
        grads = jax.grad(loss)(params, x)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    layers, d, f = 6, 64, 256
    params = (jax.ShapeDtypeStruct((layers, d, f), jnp.float32),
              jax.ShapeDtypeStruct((layers, f, d), jnp.float32))
    fsdp = (NamedSharding(mesh, P(None, "x")), NamedSharding(mesh, P(None, "x")))
    compiled = jax.jit(step, in_shardings=(fsdp, NamedSharding(mesh, P("x"))),
                       out_shardings=fsdp).lower(
        params, jax.ShapeDtypeStruct((32, d), jnp.float32)).compile()
    m = measure(compiled)
    assert m.collectives["reduce-scatter"] == CollectiveStat(layers, layers * 2 * d * f * 4)
    assert "all-reduce" not in m.collectives
    assert m.dot_flops == 3 * 2 * 32 * d * f * 2 * layers // 8


@pytest.mark.parametrize("axes, groups", [
    ("a", [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("b", [[0, 1, 2, 3], [4, 5, 6, 7]]),
    (("a", "b"), [list(range(8))]),
])
def test_real_2d_mesh_groups(axes, groups):
    mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    compiled = _compile(mesh, lambda x, w: x @ w, (P(None, axes), P(axes, None)), P(),
                        (16, 32), (32, 64))
    m = measure(compiled)
    (op,) = m.ops
    assert (op.kind, op.bytes, op.replica_groups) == ("all-reduce", 16 * 64 * 4, groups)
    n = len(groups[0])  # ring all-reduce: each device sends 2(n-1)/n of the buffer
    assert op.group_size == n and m.wire_bytes == 2 * (n - 1) / n * 16 * 64 * 4


def test_wire_bytes_weigh_reduce_scatter_plus_all_gather_as_one_all_reduce(mesh):
    # ZeRO's reduce-scatter + all-gather move twice the buffer bytes of one all-reduce, but each
    # device sends the same: (n-1)/n + (n-1)/n = 2(n-1)/n of the buffer
    reduce = measure(_compile(mesh, lambda x, w: x @ w, (P(None, "x"), P("x", None)), P(),
                              (16, 32), (32, 64)))
    scatter_gather = measure(_compile(
        mesh, lambda x, w: jax.lax.with_sharding_constraint(x @ w, NamedSharding(mesh, P("x"))) * 2,
        (P(None, "x"), P("x", None)), P(), (16, 32), (32, 64)))
    assert set(scatter_gather.collectives) == {"reduce-scatter", "all-gather"}
    assert scatter_gather.collective_bytes == 2 * reduce.collective_bytes
    assert scatter_gather.wire_bytes == reduce.wire_bytes == 2 * 7 / 8 * 16 * 64 * 4


def test_summary_and_types(mesh):
    m = measure(_scan_compiled(mesh))
    text = m.summary()
    assert "all-reduce" in text and "dot FLOPs" in text and "memory/device" in text
    assert isinstance(m.collectives["all-reduce"], CollectiveStat)
    assert m.count("all-reduce") == 4 and m.count("all-gather") == 0
    with pytest.raises(AttributeError):
        m.dot_flops = 0  # frozen


@pytest.mark.parametrize("syntax", ["mesh['a'=2] {'zz'}", "[3,3]<=[8]", "weird"])
def test_unparseable_replica_groups_name_the_line(syntax):
    text = module(f"  ROOT %ar = f32[8]{{0}} all-reduce(%v), replica_groups={syntax}, "
                  "to_apply=%add", partitions=8)
    with pytest.raises(ValueError, match="%ar = f32"):
        measure(text)
