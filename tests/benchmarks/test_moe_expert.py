"""``benchmarks/moe_expert.py``: the hand-written expert plans it holds the default plan to (per
model, the tests' plan first), the reference it picks among them and its verdicts (doctests)."""
import doctest
import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))  # for its `import _isolate`, which takes it off again
    path = os.path.join(ROOT, "benchmarks", "moe_expert.py")
    spec = importlib.util.spec_from_file_location("bench_moe_expert", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_hand_written_plans_per_model():
    from automap.zoo.corpus.moe import MoEConfig

    bench = _bench()
    einsum = list(bench.plans("einsum", MoEConfig(batch=8), None))
    assert einsum == ["hand EP, batch on data", "hand EP, batch on both", "dp + expert_parallel",
                      "dp + expert_parallel + megatron", "default"]
    four = list(bench.plans("einsum", MoEConfig(batch=4), None))
    assert four[:2] == ["hand EP, batch on data", "dp + expert_parallel"]  # 4 does not divide over 8 devices
    assert list(bench.plans("ragged", MoEConfig(), None))[:2] == ["hand EP, batch whole", "hand EP, batch on data"]
    rules = bench.plans("einsum", MoEConfig(), None)["hand EP, batch on data"]["tactics"][0].rules
    assert [(k, tuple(v)) for k, v in rules] == [(r"w_in$|w_out$", ("model", None, None)), (r"^batch/", ("data",))]
    assert bench.plans("einsum", MoEConfig(), "h100-8")["default"]["topology"].name == "h100-8"


def test_reference_and_verdicts():
    bench = _bench()
    assert doctest.testmod(bench, optionflags=doctest.ELLIPSIS).failed == 0
    m = bench.verdict.__globals__["Measurement"]
    from automap.measure import CollectiveOp, MemoryStat

    def measured(sent, memory):
        op = CollectiveOp("all-gather", 2 * sent, 1, [[0, 1]], "ag", "main", group_size=2)
        return m({}, MemoryStat(memory, 0, 0, 0), 0, [op])

    # the first is the reference unless prefer() keeps a later one (fewer bytes, memory within 5%)
    assert bench.reference({"a": measured(100, 100), "b": measured(50, 200)}) == "a"
    assert bench.reference({"a": measured(100, 100), "b": measured(50, 104)}) == "b"
