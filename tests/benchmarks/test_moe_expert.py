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
    bench = _bench()
    experts = bench.EXPERTS
    einsum = list(bench.plans(experts, 8, False, None))
    assert einsum == ["hand EP, batch on data", "hand EP, batch on both", "dp + expert_parallel",
                      "dp + expert_parallel + megatron", "default"]
    four = list(bench.plans(experts, 4, False, None))
    assert four[:2] == ["hand EP, batch on data", "dp + expert_parallel"]  # 4 does not divide over 8 devices
    assert list(bench.plans(experts, 2, True, None))[:2] == ["hand EP, batch whole", "hand EP, batch on data"]
    rules = bench.plans(experts, 2, False, None)["hand EP, batch on data"]["tactics"][0].rules
    assert [(k, tuple(v)) for k, v in rules] == [(r"w_in$|w_out$", ("model",)), (r"^batch/", ("data",))]
    assert bench.plans(experts, 2, False, "h100-8")["default"]["topology"].name == "h100-8"


def test_expert_leaves_checks_the_expert_count():
    import types

    import jax
    import pytest

    bench = _bench()

    def plan(shapes):
        avals = [jax.ShapeDtypeStruct(s, "float32") for s in shapes.values()]
        return types.SimpleNamespace(program=types.SimpleNamespace(input_paths=list(shapes)),
                                     traced=types.SimpleNamespace(in_avals=avals))

    ok = plan({"state/params/experts/w1": (8, 4, 16), "state/params/experts/w2": (8, 16, 4),
               "state/params/attn/kernel": (8, 2, 4), "batch/x": (2, 4)})
    assert bench.expert_leaves(ok, "experts/") == "2 inputs match 'experts/' (8 experts; shapes (8, 16, 4), (8, 4, 16))"
    with pytest.raises(SystemExit, match="one expert count divisible by 4"):
        bench.expert_leaves(ok, "kernel|x$")  # two counts, 8 and 2 (the batch)
    with pytest.raises(SystemExit, match="one expert count divisible by 4"):
        bench.expert_leaves(plan({"w": (6, 4)}), "w")  # 6 experts: 'model' (4) does not divide them
    with pytest.raises(SystemExit, match="one expert count divisible by 4"):
        bench.expert_leaves(ok, "nothing")


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
