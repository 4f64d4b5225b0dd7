"""Topologies: presets, mapping mesh axes to links, dict round trips, byte parsing."""
import dataclasses
import pickle

import pytest

from automap.cost import DeviceSpec, Level, Link, Topology, default_topology, parse_bytes

NV, IB = 450e9, 50e9


def _bw(topology, mesh):
    return {a: l.bandwidth for a, l in topology.links_for(mesh).items()}


def test_preset_names():
    assert Topology.presets() == ("h100-8", "h100-2x8", "tpu-v5e-8", "tpu-v5e-256", "tpu-v5p-8",
                                  "tpu-v5p-2x64", "cpu-sim")
    for name in Topology.presets():
        t = Topology.preset(name)
        assert t.name == name and t.num_devices > 1 and t.device.memory_bytes > 0


def test_unknown_preset_lists_all_names():
    with pytest.raises(ValueError, match="unknown topology preset 'h200'") as e:
        Topology.preset("h200")
    for name in Topology.presets():
        assert name in str(e.value)


@pytest.mark.parametrize("name,devices,flops,memory,membw,inner_bw", [
    ("h100-8", 8, 989e12, 80 * 2**30, 3.35e12, NV),
    ("h100-2x8", 16, 989e12, 80 * 2**30, 3.35e12, NV),
    ("tpu-v5e-8", 8, 197e12, 16 * 2**30, 819e9, 100e9),
    ("tpu-v5e-256", 256, 197e12, 16 * 2**30, 819e9, 100e9),
    ("tpu-v5p-8", 8, 459e12, 95 * 2**30, 2.76e12, 200e9),
    ("tpu-v5p-2x64", 128, 459e12, 95 * 2**30, 2.76e12, 200e9),
    ("cpu-sim", 8, 50e9, 4 * 2**30, 10e9, 5e9),
])
def test_preset_numbers(name, devices, flops, memory, membw, inner_bw):
    t = Topology.preset(name)
    assert (t.num_devices, t.device.peak_flops, t.device.memory_bytes, t.device.memory_bandwidth,
            t.levels[0].link.bandwidth) == (devices, flops, memory, membw, inner_bw)


# preset, mesh (in order), expected bandwidth per axis
LINK_CASES = [
    ("h100-2x8", {"data": 2, "model": 8}, {"data": IB, "model": NV}),
    ("h100-2x8", {"model": 8, "data": 2}, {"model": IB, "data": NV}),
    ("h100-2x8", {"data": 16}, {"data": IB}),
    ("h100-2x8", {"data": 4, "model": 4}, {"data": IB, "model": NV}),
    ("h100-2x8", {"a": 2, "b": 2, "c": 4}, {"a": IB, "b": NV, "c": NV}),
    ("h100-2x8", {"data": 8}, {"data": NV}),                       # fits in one node
    ("h100-2x8", {"one": 1, "model": 8, "data": 2}, {"one": NV, "model": IB, "data": NV}),
    ("h100-2x8", {"data": 2, "rest": 1}, {"data": NV, "rest": NV}),
    ("h100-2x8", {"a": 4, "b": 3}, {"a": IB, "b": IB}),  # b group {6,7,8} straddles the nodes
    ("h100-8", {"data": 2, "model": 4}, {"data": NV, "model": NV}),
    ("tpu-v5p-2x64", {"dcn": 2, "fsdp": 16, "tp": 4}, {"dcn": 25e9, "fsdp": 200e9, "tp": 200e9}),
    ("h100-2x8", {}, {}),
]


@pytest.mark.parametrize("name,mesh,want", LINK_CASES)
def test_links_for(name, mesh, want):
    t = Topology.preset(name)
    assert _bw(t, mesh) == want
    assert list(t.links_for(mesh)) == list(mesh)
    for axis in mesh:
        assert t.link(axis, mesh).bandwidth == want[axis]


def test_three_levels_pick_outermost_crossed():
    l0, l1, l2 = Link(100.0, 1e-6), Link(10.0, 1e-5), Link(1.0, 1e-4)
    t = Topology("t", Topology.preset("cpu-sim").device,
                 (Level(2, l0, "chip"), Level(4, l1, "node"), Level(2, l2, "rack")))
    assert t.links_for({"r": 2, "n": 4, "c": 2}) == {"r": l2, "n": l1, "c": l0}
    assert t.links_for({"x": 16}) == {"x": l2}
    assert t.links_for({"x": 4, "y": 4}) == {"x": l2, "y": l1}


def test_explicit_links_override_hierarchy():
    t = Topology.preset("h100-2x8").with_links(data=Link(12.5e9, 2e-5))
    assert _bw(t, {"data": 2, "model": 8}) == {"data": 12.5e9, "model": NV}
    # explicit links alone (no levels) describe a heterogeneous cluster of any size
    het = Topology("het", Topology.preset("h100-8").device,
                   links={"pp": Link(1e9, 1e-4), "dp": Link(25e9, 1e-5), "tp": Link(NV, 3e-6)})
    assert _bw(het, {"pp": 4, "dp": 8, "tp": 8}) == {"pp": 1e9, "dp": 25e9, "tp": NV}
    assert het.with_links(pp=Link(2e9, 1e-4)).links["pp"].bandwidth == 2e9
    assert het.links["pp"].bandwidth == 1e9  # with_links does not mutate


# devices, backend -> name, devices in the hierarchy, mesh (in order) and its bandwidth per axis
DEFAULT_CASES = [
    (8, "cpu", "cpu-sim", 8, {"data": 2, "model": 4}, {"data": 5e9, "model": 5e9}),
    (4, "gpu", "h100-8", 8, {"data": 4}, {"data": NV}),
    (64, "cpu", "cpu-sim-64", 64, {"data": 8, "model": 8}, {"data": 5e9, "model": 5e9}),
    (1000, "cpu", "cpu-sim-1000", 1000, {"data": 1000}, {"data": 5e9}),
    (16, "gpu", "h100-2x8", 16, {"data": 2, "model": 8}, {"data": IB, "model": NV}),
    (64, "gpu", "h100-8x8", 64, {"node": 8, "gpu": 8}, {"node": IB, "gpu": NV}),
    (64, "gpu", "h100-8x8", 64, {"gpu": 8, "node": 8}, {"gpu": IB, "node": NV}),
    (12, "gpu", "h100-2x8", 16, {"data": 12}, {"data": IB}),  # a partial node counts whole
    (64, "tpu", "tpu-v5e-64", 64, {"data": 64}, {"data": 100e9}),
    (512, "tpu", "tpu-v5e-2x256", 512, {"dcn": 2, "ici": 256}, {"dcn": 25e9, "ici": 100e9}),
]


@pytest.mark.parametrize("n,backend,name,devices,mesh,want", DEFAULT_CASES)
def test_default_topology_fits_any_device_count(n, backend, name, devices, mesh, want):
    t = default_topology(n, backend)
    assert (t.name, t.num_devices, _bw(t, mesh)) == (name, devices, want)
    if name in Topology.presets():
        assert t == Topology.preset(name)


def test_default_topology_of_the_test_backend():
    assert default_topology() == Topology.preset("cpu-sim")  # 8 simulated CPU devices
    with pytest.raises(ValueError, match="num_devices must be an int >= 1"):
        default_topology(0)


@pytest.mark.parametrize("topology,mesh,match", [
    (Topology.preset("h100-2x8"), {"data": 4, "model": 8}, "32 devices.*16"),
    (Topology("x", Topology.preset("cpu-sim").device), {"d": 2}, "no link for mesh axes"),
    (Topology.preset("h100-8"), {"d": 0}, "sizes must be ints >= 1"),
])
def test_links_for_errors(topology, mesh, match):
    with pytest.raises(ValueError, match=match):
        topology.links_for(mesh)


def test_link_unknown_axis():
    with pytest.raises(ValueError, match=r"not a mesh axis.*\['data'\]"):
        Topology.preset("h100-8").link("model", {"data": 8})


@pytest.mark.parametrize("name", Topology.presets())
def test_dict_round_trip(name):
    t = Topology.preset(name).with_links(extra=Link(1e9, 1e-3))
    assert Topology.from_dict(t.to_dict()) == t
    assert hash(Topology.from_dict(t.to_dict())) == hash(t)
    assert pickle.loads(pickle.dumps(t)) == t


def test_from_dict_with_levels_and_string_memory():
    t = Topology.from_dict({
        "name": "mine",
        "device": {"name": "gpu", "peak_flops": 1e15, "memory_bytes": "80GB",
                   "memory_bandwidth": 2e12},
        "levels": [{"size": 4, "bandwidth": 300e9, "latency": 2e-6, "name": "nvlink"},
                   {"size": 4, "bandwidth": 25e9, "latency": 8e-6}],
        "links": {"pp": {"bandwidth": 5e9, "latency": 1e-4}},
    })
    assert t.device.memory_bytes == 80 * 10**9 and t.num_devices == 16
    assert t.levels[1].name == ""
    assert _bw(t, {"pp": 2, "dp": 2, "tp": 4}) == {"pp": 5e9, "dp": 25e9, "tp": 300e9}


def test_from_dict_preset_with_overrides():
    t = Topology.from_dict({"preset": "h100-2x8", "device": {"memory_bytes": "40GiB"},
                            "links": {"data": {"bandwidth": 25e9, "latency": 1e-5}}})
    base = Topology.preset("h100-2x8")
    assert t.device == dataclasses.replace(base.device, memory_bytes=40 * 2**30)
    assert t.levels == base.levels and t.name == "h100-2x8"
    assert _bw(t, {"data": 2, "model": 8}) == {"data": 25e9, "model": NV}
    one_level = Topology.from_dict({"preset": "h100-2x8", "name": "flat",
                                    "levels": [{"size": 16, "bandwidth": 1e11, "latency": 1e-6}]})
    assert one_level.name == "flat" and _bw(one_level, {"d": 16}) == {"d": 1e11}


@pytest.mark.parametrize("d,match", [
    ({"preset": "nope"}, "unknown topology preset"),
    ({"preset": "h100-8", "devices": {}}, r"unknown keys \['devices'\]"),
    ({"device": {"peak_flops": 1e12}},
     r"needs device fields \['memory_bandwidth', 'memory_bytes'\]"),
    ({"preset": "h100-8", "device": {"flops": 1}}, r"unknown keys \['flops'\] in device"),
    ({"preset": "h100-8", "links": {"d": {"bandwidth": 1e9}}}, "needs both 'bandwidth'"),
    ({"preset": "h100-8", "levels": [{"size": 0, "bandwidth": 1e9, "latency": 0}]}, "Level.size"),
    ({"preset": "h100-8", "device": {"memory_bytes": "80 parsecs"}}, "cannot parse byte count"),
    ({"preset": "h100-8", "links": {"d": {"bandwidth": -1, "latency": 0}}}, "Link.bandwidth"),
])
def test_from_dict_errors(d, match):
    with pytest.raises(ValueError, match=match):
        Topology.from_dict(d)


@pytest.mark.parametrize("value,want", [
    (4096, 4096), ("4096", 4096), ("16GiB", 16 * 2**30), ("80GB", 80 * 10**9), ("80gb", 80 * 10**9),
    ("1.5 KiB", 1536), ("2MiB", 2 * 2**20), ("3 TB", 3 * 10**12), ("1e3B", 1000), (2.0, 2),
    ("0", 0),
])
def test_parse_bytes(value, want):
    assert parse_bytes(value) == want


@pytest.mark.parametrize("value,error", [
    ("16 GiBs", ValueError), ("GiB", ValueError), (-1, ValueError), (1.5, ValueError),
    (True, TypeError), (None, TypeError),
])
def test_parse_bytes_errors(value, error):
    with pytest.raises(error):
        parse_bytes(value)


def test_validation_says_what_to_fix():
    with pytest.raises(ValueError, match="Link.latency must be a finite number >= 0"):
        Link(1e9, -1.0)
    with pytest.raises(ValueError, match="DeviceSpec.peak_flops"):
        DeviceSpec("d", 0, "1GiB", 1e9)
    with pytest.raises(TypeError, match="Level.link must be a Link"):
        Level(2, {"bandwidth": 1e9, "latency": 0})
    with pytest.raises(TypeError, match=r"links\['x'\] must be a Link"):
        Topology("t", Topology.preset("cpu-sim").device, links={"x": 5e9})
