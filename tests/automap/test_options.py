"""Every option of automap.automap / automap.partition, every searcher field and automap.measure's
input is checked up front, with an error naming the option, the bad value and the fix."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import automap
import search
import tactics
from search.planning import MemoryBudgetError

MESH = automap.make_mesh({"data": 2, "model": 4})


def raises(exc, *fragments):
    return pytest.raises(exc, match="(?s)" + "".join(f"(?=.*{re.escape(f)})" for f in fragments))


def step(w, x):
    return jnp.tanh(x @ w).sum()


W, X = np.ones((64, 64), np.float32), np.ones((8, 64), np.float32)


@pytest.mark.parametrize("options, exc, fragments", [
    ({"memory_budget": "lots"}, ValueError, ["memory_budget='lots'", "cannot parse", "'16GiB'"]),
    ({"memory_budget": [1]}, TypeError, ["memory_budget=[1]", "'16GiB'"]),
    ({"memory_budget": -1}, ValueError, ["memory_budget=-1", ">= 0"]),
    ({"memory_budget": True}, TypeError, ["memory_budget=True"]),
    ({"pins": "some"}, ValueError, ["pins='some'", "'anchors', 'all', 'none']"]),
    ({"pins": None}, ValueError, ["pins=None", "the default is 'plan'"]),
    ({"donate_argnums": "0"}, TypeError, ["donate_argnums='0'", "ints >= 0", "donate_argnums=(0,)"]),
    ({"donate_argnums": (-1,)}, TypeError, ["donate_argnums=(-1,)"]),
    ({"static_argnums": (1.0,)}, TypeError, ["static_argnums=(1.0,)"]),
    ({"tactics": "data"}, TypeError, ["tactics must be a list", "'data'"]),
    ({"tactics": ["data"]}, TypeError, ["tactics must be tactic objects", "tactics.data_parallel('data')"]),
    ({"tactics": [tactics.data_parallel("dta")]}, ValueError,
     ["data_parallel('dta')", "mesh axis 'dta'", "('data', 'model')", "use one of those"]),
    ({"tactics": [tactics.megatron("tensor")]}, ValueError, ["megatron('tensor')", "('data', 'model')"]),
    ({"tactics": [tactics.fsdp("fsdp")]}, ValueError, ["'fsdp'", "('data', 'model')"]),
    ({"tactics": tactics.presets.megatron_dp(model="mp")}, ValueError, ["megatron('mp')", "('data', 'model')"]),
    ({"search": "mcts"}, TypeError, ["search must be a searcher", "'mcts'"]),
])
def test_bad_option_is_named(options, exc, fragments):
    with raises(exc, *fragments):
        automap.partition(step, mesh=MESH, **options)


@pytest.mark.parametrize("argnums", ["donate_argnums", "static_argnums"])
def test_argnums_out_of_range(argnums):
    f = automap.partition(lambda w, x: step(w, x), mesh=MESH, **{argnums: (5,)})
    with raises(ValueError, f"{argnums}=(5,)", "argument 5", "2 arguments were given"):
        f.plan(W, X)


def test_one_tactic_instead_of_a_list():
    one = automap.partition(step, mesh=MESH, tactics=tactics.data_parallel("data"), search=None).plan(W, X)
    listed = automap.partition(step, mesh=MESH, tactics=[tactics.data_parallel("data")], search=None).plan(W, X)
    assert one.in_shardings == listed.in_shardings == (jax.sharding.NamedSharding(MESH, P(None, "data")),
                                                       jax.sharding.NamedSharding(MESH, P("data")))


@pytest.mark.parametrize("axes, options", [
    ({"data": 2, "model": 4}, {"search": None}),  # no search at all
    ({"data": 8}, {"tactics": [tactics.data_parallel("data")]}),  # search="auto": the tactics use every axis
    ({"data": 2, "model": 4}, {"tactics": [tactics.data_parallel("data")], "search": None}),
])
def test_memory_budget_is_checked_without_a_search(axes, options):
    mesh = automap.make_mesh(axes)
    f = automap.partition(step, mesh=mesh, memory_budget="1KiB", **options)
    with raises(MemoryBudgetError, "memory_budget='1KiB'", "no search ran", "w (", "Raise memory_budget"):
        f.plan(W, X)
    plan = automap.partition(step, mesh=mesh, memory_budget="1MiB", **options).plan(W, X)  # fits: planned
    assert not any(n.startswith("search") for n in plan.notes)
    assert 1 << 10 < plan.estimate.peak_memory_bytes <= 1 << 20


@pytest.mark.parametrize("searcher, exc, fragments", [
    (lambda: search.MCTS(episodes=-5), ValueError, ["MCTS(episodes=-5)", "integer >= 1", "MCTS(episodes=48)"]),
    (lambda: search.MCTS(episodes=2.5), TypeError, ["MCTS(episodes=2.5)", "integer"]),
    (lambda: search.MCTS(exploration="high"), TypeError, ["MCTS(exploration='high')", "number >= 0"]),
    (lambda: search.MCTS(time_budget_s=-1.0), ValueError, ["time_budget_s=-1.0", "or None"]),
    (lambda: search.MCTS(tie_tolerance=float("nan")), ValueError, ["tie_tolerance=nan"]),
    (lambda: search.MCTS(seed_tactics="yes"), TypeError, ["seed_tactics='yes'", "True or False"]),
    (lambda: search.MCTS(rollout_fn=3), TypeError, ["rollout_fn=3", "function"]),
    (lambda: search.Greedy(max_steps=-1), ValueError, ["Greedy(max_steps=-1)", "integer >= 0"]),
    (lambda: search.ILP(max_evaluations=0), ValueError, ["ILP(max_evaluations=0)", "integer >= 1"]),
    (lambda: search.ILP(time_limit_s=-2), ValueError, ["ILP(time_limit_s=-2)"]),
])
def test_bad_searcher_field_is_named(searcher, exc, fragments):
    with raises(exc, *fragments):
        searcher()


def test_good_searcher_fields_pass():
    assert search.MCTS(episodes=np.int64(3), time_budget_s=None).episodes == 3
    assert search.ILP(time_limit_s=float("inf")).time_limit_s == float("inf")
    assert search.Greedy(max_steps=0).max_steps == 0


def test_an_invalid_manual_regex_names_the_rule():
    with raises(re.error, "manual rule 'layers[0'", "not a valid regex", "re.escape"):
        tactics.manual({"layers[0": P()})
    with raises(TypeError, "manual rule 3", "regex string"):
        tactics.manual({3: P()})


@pytest.mark.parametrize("text", ["hello world", "", "HloModule empty\n"])
def test_measure_on_text_that_is_not_hlo(text):
    with raises(ValueError, "not HLO", repr(text.strip()[:60]), "compiled.as_text()"):
        automap.measure(text)
