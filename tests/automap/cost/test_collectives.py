"""Alpha-beta collective costs: closed forms, scaling, multi-axis groups, errors."""
import math

import pytest

from automap.cost import Link, Topology, collective_time, group_size, wire_bytes
from automap.cost.collectives import KINDS

S = 1200.0

# kind, n, expected wire bytes (DESIGN.md section 4), expected latency steps
RING_CASES = [
    ("all-reduce", 4, 2 * 3 / 4 * S, 6),
    ("all-reduce", 8, 2 * 7 / 8 * S, 14),
    ("all-gather", 4, 3 / 4 * S, 3),
    ("reduce-scatter", 6, 5 / 6 * S, 5),
    ("all-to-all", 4, 3 / 16 * S, 3),
    ("all-to-all", 8, 7 / 64 * S, 7),
    ("collective-permute", 2, S, 1),
    ("collective-permute", 8, S, 1),
]


def _flat(bandwidth=1e9, latency=1e-6, axes=("x",)):
    dev = {"peak_flops": 1e12, "memory_bytes": "1GiB", "memory_bandwidth": 1e11}
    return Topology.from_dict({"device": dev, "links": {
        a: {"bandwidth": bandwidth, "latency": latency} for a in axes}})


@pytest.mark.parametrize("kind,n,want,_steps", RING_CASES)
def test_wire_bytes_closed_forms(kind, n, want, _steps):
    assert wire_bytes(kind, S, n) == pytest.approx(want)


@pytest.mark.parametrize("kind,n,want,steps", RING_CASES)
def test_time_is_steps_latency_plus_bytes_over_bandwidth(kind, n, want, steps):
    t = _flat(bandwidth=2e9, latency=3e-6)
    got = collective_time(kind, S, ["x"], {"x": n}, t)
    assert got == pytest.approx(steps * 3e-6 + want / 2e9)


@pytest.mark.parametrize("kind", KINDS)
def test_group_of_one_costs_nothing(kind):
    assert wire_bytes(kind, S, 1) == 0.0
    assert collective_time(kind, S, ["x"], {"x": 1, "y": 4}, _flat(axes=("x", "y"))) == 0.0
    assert collective_time(kind, S, [], {"x": 4}, _flat()) == 0.0


@pytest.mark.parametrize("kind", KINDS)
def test_time_scales_with_latency_and_bandwidth(kind):
    base = collective_time(kind, 0.0, ["x"], {"x": 4}, _flat(latency=1e-6))
    doubled = collective_time(kind, 0.0, ["x"], {"x": 4}, _flat(latency=2e-6))
    assert doubled == pytest.approx(2 * base)
    big = 1e12  # bandwidth term dominates
    slow = collective_time(kind, big, ["x"], {"x": 4}, _flat(bandwidth=1e9, latency=0.0))
    fast = collective_time(kind, big, ["x"], {"x": 4}, _flat(bandwidth=4e9, latency=0.0))
    assert slow == pytest.approx(4 * fast)
    assert collective_time(kind, 2 * big, ["x"], {"x": 4}, _flat(latency=0.0)) == pytest.approx(
        2 * collective_time(kind, big, ["x"], {"x": 4}, _flat(latency=0.0)))


def test_multi_axis_group_uses_slowest_link_and_product_size():
    t = _flat(axes=("a", "b")).with_links(a=Link(10e9, 1e-6), b=Link(2e9, 5e-6))
    mesh = {"a": 4, "b": 2}
    n = 8
    want = 2 * (n - 1) * 5e-6 + wire_bytes("all-reduce", S, n) / 2e9
    assert collective_time("all-reduce", S, ["a", "b"], mesh, t) == pytest.approx(want)
    assert collective_time("all-reduce", S, ["b", "a"], mesh, t) == pytest.approx(want)
    # a size-1 axis in the group contributes neither size nor its (slow) link
    t2 = t.with_links(c=Link(1.0, 1.0))
    assert collective_time("all-gather", S, ["a", "c"], {"a": 4, "c": 1}, t2) == pytest.approx(
        collective_time("all-gather", S, ["a"], {"a": 4, "c": 1}, t2))


def test_hierarchy_gives_inner_axis_the_faster_link():
    t = Topology.preset("h100-2x8")
    mesh = {"data": 2, "model": 8}
    nv, ib = 450e9, 50e9
    model = collective_time("all-gather", S, "model", mesh, t)
    data = collective_time("all-gather", S, "data", mesh, t)
    assert model == pytest.approx(7 * 3e-6 + 7 / 8 * S / nv)
    assert data == pytest.approx(1 * 5e-6 + 1 / 2 * S / ib)
    both = collective_time("all-gather", S, ["data", "model"], mesh, t)
    assert both == pytest.approx(15 * 5e-6 + 15 / 16 * S / ib)


@pytest.mark.parametrize("axes,mesh,n", [
    (["x"], {"x": 4, "y": 2}, 4),
    (["x", "y"], {"x": 4, "y": 2}, 8),
    ("y", {"x": 4, "y": 2}, 2),
    ((), {"x": 4}, 1),
])
def test_group_size(axes, mesh, n):
    assert group_size(axes, mesh) == n


@pytest.mark.parametrize("call,match", [
    (lambda: wire_bytes("all-gatherr", S, 2), "all-reduce, all-gather, reduce-scatter"),
    (lambda: collective_time("psum", S, ["x"], {"x": 2}, _flat()), "unknown collective kind"),
    (lambda: group_size(["z"], {"x": 2}), r"not in the mesh.*\['x'\]"),
    (lambda: group_size(["x", "x"], {"x": 2}), "repeat"),
    (lambda: wire_bytes("all-reduce", S, 0), "group size"),
    (lambda: wire_bytes("all-reduce", -1, 2), "nbytes"),
])
def test_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_realistic_magnitude():
    # 1 GiB all-reduce over 8 H100s on NVLink: about 2*7/8 GiB / 450 GB/s ~ 4.2 ms
    t = collective_time("all-reduce", 2**30, ["d"], {"d": 8}, Topology.preset("h100-8"))
    assert math.isclose(t, 14 * 3e-6 + 1.75 * 2**30 / 450e9)
    assert 3e-3 < t < 6e-3
