"""Plan files: plan.save / automap.Plan.load / automap(fn, plan=path) round trips, the fingerprint,
and errors naming what changed (function, shapes, mesh)."""
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import automap
import tactics
from automap import zoo
from automap.plan_io import PlanMismatchError, StoredPlan

MESH = automap.make_mesh({"data": 2, "model": 4})
CFG = zoo.GPTConfig(layers=2, d_model=32, heads=4, vocab=64, seq=16, batch=8)
TP_DP = [tactics.megatron("model"), tactics.data_parallel("data")]


def raises(exc, *fragments):
    return pytest.raises(exc, match="(?s)" + "".join(f"(?=.*{re.escape(f)})" for f in fragments))


def step(params, batch):
    loss = lambda p: jnp.tanh(batch["x"] @ p["w"]).sum()  # noqa: E731
    value, g = jax.value_and_grad(loss)(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, g), value


def other_step(params, batch):  # the same paths and shapes, another body
    loss = lambda p: jnp.sin(batch["x"] @ p["w"]).sum()  # noqa: E731
    value, g = jax.value_and_grad(loss)(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, g), value


PARAMS = {"w": np.full((16, 8), 0.1, np.float32)}
BATCH = {"x": np.linspace(-0.5, 1, 8 * 16, dtype=np.float32).reshape(8, 16)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("plans") / "step.json")
    plan = automap.partition(step, mesh=MESH, tactics=TP_DP).plan(PARAMS, BATCH)
    plan.save(path)
    return path, plan


# ---------------------------------------------------------------------------- round trips

@pytest.mark.parametrize("make, cfg", [
    (zoo.gpt_linen, CFG),
    (zoo.gpt_nnx, CFG.__class__(**{**CFG.__dict__, "scan": True, "remat": True})),
], ids=["gpt_linen", "gpt_nnx_scan_remat"])
def test_round_trip_gives_the_same_plan_and_program(tmp_path, make, cfg):
    w = make(cfg)
    state, batch = w.abstract()
    planned = automap.partition(w.train_step, mesh=MESH, tactics=TP_DP)
    plan = planned.plan(state, batch)
    path = tmp_path / "plan.json"
    plan.save(path)

    loaded = automap.Plan.load(path, MESH, w.train_step, (state, batch))
    assert loaded.fingerprint == plan.fingerprint
    assert loaded.in_shardings == plan.in_shardings and loaded.out_shardings == plan.out_shardings
    assert loaded.pins == plan.pins and dict(loaded.state.specs) == dict(plan.state.specs)
    assert loaded.reshards == plan.reshards and loaded.estimate == plan.estimate
    assert any("loaded from" in n for n in loaded.notes)

    from_file = automap.automap(w.train_step, mesh=MESH, plan=str(path))
    assert from_file.plan(state, batch).in_shardings == plan.in_shardings
    # the very same program (so the same compiled collectives; compiled below on a small step)
    assert from_file.lower(state, batch).as_text() == planned.lower(state, batch).as_text()


def test_a_plan_file_skips_the_tactics_and_computes_the_same(saved, monkeypatch):
    path, plan = saved
    import automap.planner

    monkeypatch.setattr(automap.planner, "make_plan", lambda *a, **k: pytest.fail("replanned"))
    f = automap.automap(step, mesh=MESH, plan=path)
    p = f.plan(PARAMS, BATCH)
    assert p.in_shardings == plan.in_shardings and f.plan(PARAMS, BATCH) is p
    want = automap.measure(automap.partition(step, mesh=MESH, plan=plan).lower(PARAMS, BATCH).compile())
    got = automap.measure(f.lower(PARAMS, BATCH).compile())
    assert got.collectives == want.collectives and got.collectives
    new_params, loss = f(PARAMS, BATCH)
    want_params, want_loss = jax.jit(step)(PARAMS, BATCH)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(new_params["w"]), np.asarray(want_params["w"]), rtol=1e-5, atol=1e-6)
    assert new_params["w"].sharding == plan.in_shardings[0]["w"]


def test_load_without_a_function_gives_a_stored_plan(saved):
    path, plan = saved
    stored = automap.Plan.load(path, MESH)
    assert isinstance(stored, StoredPlan) and stored.fingerprint == plan.fingerprint
    f = automap.partition(step, mesh=MESH, plan=stored)
    assert f.plan(PARAMS, BATCH).out_shardings == plan.out_shardings
    with raises(TypeError, "needs args"):
        automap.Plan.load(path, MESH, step)


def test_file_contents(saved):
    path, plan = saved
    data = json.load(open(path))
    assert data["format"] == "automap-plan" and data["version"] == 1
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", data["fingerprint"]) and data["fingerprint"] == plan.fingerprint
    assert data["mesh"] == {"axis_names": ["data", "model"], "axis_sizes": [2, 4]}
    rows = {r["path"]: r for r in data["inputs"]}
    assert set(rows) == {"params/w", "batch/x"}
    assert rows["batch/x"]["shape"] == [8, 16] and rows["batch/x"]["dtype"] == "float32"
    assert rows["batch/x"]["spec"] == [["data"], []]
    assert rows["params/w"]["spec"] == [list(a) for a in plan.state.spec(rows["params/w"]["value"])]
    assert [r["path"] for r in data["outputs"]] == list(plan.program.output_paths)
    assert data["pins"] == sorted(plan.pins) and len(data["ops"]) == len(plan.program.all_ops)


_FINGERPRINT = """
import os, sys
sys.path.insert(0, {root!r})
import jax.numpy as jnp, automap
from automap import zoo
w = zoo.gpt_nnx(zoo.GPTConfig(layers=2, d_model=32, heads=4, vocab=64, seq=16, batch=8, scan=True))
print(automap.partition(w.train_step, mesh=automap.make_mesh({{"data": 8}}), search=None, arbiter=None)
      .plan(*w.abstract()).fingerprint)
"""


def test_fingerprint_is_the_same_in_another_process():
    w = zoo.gpt_nnx(zoo.GPTConfig(layers=2, d_model=32, heads=4, vocab=64, seq=16, batch=8, scan=True))
    # the fingerprint is the traced function's and the shapes' (no search needed: it does not enter it)
    here = automap.partition(w.train_step, mesh=automap.make_mesh({"data": 8}), search=None,
                             arbiter=None).plan(*w.abstract()).fingerprint
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONHASHSEED="123", JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0")
    out = subprocess.run([sys.executable, "-c", _FINGERPRINT.format(root=root)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == here


def test_fingerprint_changes_with_the_function_and_shapes(saved):
    _, plan = saved
    f = lambda fn, *args: automap.partition(fn, mesh=MESH).plan(*args).fingerprint  # noqa: E731
    assert f(step, PARAMS, BATCH) == plan.fingerprint  # tactics do not enter it
    assert f(other_step, PARAMS, BATCH) != plan.fingerprint
    assert f(step, PARAMS, {"x": np.ones((16, 16), np.float32)}) != plan.fingerprint
    assert f(step, PARAMS, {"x": np.ones((8, 16), jnp.bfloat16)}) != plan.fingerprint
    x = np.ones((8, 4), np.float32)
    assert f(lambda x: x * 2, x) == f(lambda x: x * 2, x) != f(lambda x: x * 3, x)


def test_a_changed_constant_is_named(tmp_path):
    x = np.ones((8, 4), np.float32)
    automap.partition(lambda x: x * 2, mesh=MESH).plan(x).save(tmp_path / "p.json")
    with raises(PlanMismatchError, "other constants or op parameters", "replan"):
        automap.Plan.load(tmp_path / "p.json", MESH, lambda x: x * 3, (x,))


# ---------------------------------------------------------------------------- errors

@pytest.mark.parametrize("fn, params, batch, fragments", [
    (other_step, PARAMS, BATCH, ["function's body changed at op", "'tanh float32[8,8] -> float32[8,8]'",
                                 "'sin float32[8,8] -> float32[8,8]'", "test_plan_io.py"]),
    (step, PARAMS, {"x": np.ones((16, 16), np.float32)}, ["input 'batch/x' was float32[8, 16], now float32[16, 16]"]),
    (step, {"w": np.ones((16, 4), np.float32)}, BATCH, ["input 'params/w' was float32[16, 8], now float32[16, 4]",
                                                        "output 'out/0/w'"]),
    (step, PARAMS, {"x": BATCH["x"], "mask": np.ones(8, np.float32)}, ["input 'batch/mask' is new"]),
    (lambda params, inputs: step(params, inputs), PARAMS, BATCH, ["input 'batch/x' is gone", "input 'inputs/x' is new"]),
])
def test_a_changed_function_or_shapes_names_what_changed(saved, fn, params, batch, fragments):
    path, _ = saved
    with raises(PlanMismatchError, "was saved for another program", *fragments, "replan"):
        automap.Plan.load(path, MESH, fn, (params, batch))
    with raises(PlanMismatchError, *fragments):
        automap.automap(fn, mesh=MESH, plan=path).plan(params, batch)


@pytest.mark.parametrize("axes, fragments", [
    ({"data": 4, "model": 2}, ["axis 'data': size 2 in the plan, 4 in the mesh", "axis 'model': size 4 in the plan, 2"]),
    ({"data": 8}, ["axis 'model' is missing from the mesh"]),
    ({"batch": 2, "model": 4}, ["axis 'data' is missing", "axis 'batch' is not in the plan"]),
    ({"model": 4, "data": 2}, ["axis order ['data', 'model'] in the plan, ['model', 'data'] in the mesh"]),
])
def test_another_mesh_names_the_axes(saved, axes, fragments):
    path, _ = saved
    mesh = automap.make_mesh(axes)
    common = ["saved for mesh {'data': 2, 'model': 4}", "automap.make_mesh({'data': 2, 'model': 4})", "replan"]
    with raises(PlanMismatchError, *common, *fragments):
        automap.Plan.load(path, mesh)
    with raises(PlanMismatchError, *fragments):
        automap.automap(step, mesh=mesh, plan=path)
    with raises(PlanMismatchError, *fragments):
        automap.automap(step, mesh=mesh, plan=automap.Plan.load(path, MESH))


def test_not_a_plan_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with raises(PlanMismatchError, "not a plan file", "plan.save(path)"):
        automap.Plan.load(bad, MESH)
    bad.write_text('{"hello": 1}')
    with raises(PlanMismatchError, "not an automap plan file"):
        automap.Plan.load(bad, MESH)


def test_other_format_version(saved, tmp_path):
    path, _ = saved
    data = json.load(open(path))
    data["version"] = 99
    newer = tmp_path / "newer.json"
    newer.write_text(json.dumps(data))
    with raises(PlanMismatchError, "version 99", "reads version 1", "replan"):
        automap.Plan.load(newer, MESH)


# ---------------------------------------------------------------------------- the schema

def _set(*keys_and_value):
    *keys, value = keys_and_value

    def edit(data):
        target = data
        for k in keys[:-1]:
            target = target[k]
        if value is DELETE:
            del target[keys[-1]]
        else:
            target[keys[-1]] = value
    return edit


DELETE = object()


@pytest.mark.parametrize("edit, fragments", [
    (_set("fingerprint", DELETE), ["field 'fingerprint' is missing"]),
    (_set("fingerprint", 5), ["field 'fingerprint'", "must be a string", "int 5"]),
    (_set("fingerprint", "md5:0"), ["field 'fingerprint'", "'sha256:'"]),
    (_set("mesh", DELETE), ["field 'mesh' is missing"]),
    (_set("mesh", [2, 4]), ["field 'mesh'", "axis_names and axis_sizes"]),
    (_set("mesh", "axis_sizes", [2]), ["field 'mesh.axis_sizes'", "must have 2 entries"]),
    (_set("mesh", "axis_sizes", 0, "2"), ["field 'mesh.axis_sizes[0]'", "integer >= 1", "'2'"]),
    (_set("mesh", "axis_names", ["data", "data"]), ["field 'mesh.axis_names'", "names an axis twice"]),
    (_set("inputs", {}), ["field 'inputs'", "must be a list", "dict"]),
    (_set("inputs", 0, "spec", DELETE), ["field 'inputs[0].spec' is missing"]),
    (_set("inputs", 0, "spec", [["modle"], []]), ["field 'inputs[0].spec[0]'", "mesh axis 'modle'",
                                                  "['data', 'model']"]),
    (_set("inputs", 0, "spec", [[]]), ["field 'inputs[0].spec'", "must have 2 entries"]),
    (_set("inputs", 0, "shape", [16, -1]), ["field 'inputs[0].shape[1]'", "integer >= 0"]),
    (_set("outputs", 0, "dtype", None), ["field 'outputs[0].dtype'", "must be a string"]),
    (_set("outputs", 0, "value", "7"), ["field 'outputs[0].value'", "integer"]),
    (_set("values", 0, [3]), ["field 'values[0]'", "must have 2 entries"]),
    (_set("values", 0, 1, [["model", "model"], []]), ["field 'values[0][1][0]'", "'model' a second time"]),
    (_set("values", 0, 1, [["nope"], []]), ["field 'values[0][1][0]'", "'nope'"]),
    (_set("priority", 0, [1, "a", 2]), ["field 'priority[0][1]'", "integer"]),
    (_set("labels", []), ["field 'labels'", "must map priorities"]),
    (_set("next_priority", -1), ["field 'next_priority'", "integer >= 0", "-1"]),
    (_set("pins", "all"), ["field 'pins'", "must be a list"]),
    (_set("notes", [1]), ["field 'notes[0]'", "must be a string"]),
])
def test_a_malformed_field_is_named(saved, tmp_path, edit, fragments):
    from automap.plan_schema import PlanFileError

    bad = _edited(saved, tmp_path, edit)
    with raises(PlanFileError, str(bad), *fragments, "replan"):
        automap.Plan.load(bad, MESH)
    with raises(PlanMismatchError, str(bad)):  # a subclass: one except clause catches every plan-file problem
        automap.automap(step, mesh=MESH, plan=str(bad))


def _edited(saved, tmp_path, edit):
    data = json.load(open(saved[0]))
    edit(data)
    bad = tmp_path / "edited.json"
    bad.write_text(json.dumps(data))
    return bad


def _first_sharded(data):
    return next(i for i, (_, spec) in enumerate(data["values"]) if any(spec))


@pytest.mark.parametrize("edit, fragments", [
    (lambda d: d["values"].__setitem__(0, [10 ** 6, d["values"][0][1]]), ["field 'values[0][1]'", "value 1000000"]),
    (lambda d: d["values"][_first_sharded(d)][1].append([]), ["field 'values[", "entries for value", "of rank"]),
    (lambda d: d["priority"].__setitem__(0, [d["priority"][0][0], 7, 0]), ["field 'priority[0][1]'", "dim 7"]),
    (lambda d: d["pins"].append(10 ** 6), ["field 'pins[", "value 1000000"]),
])
def test_ids_and_specs_that_do_not_fit_the_program(saved, tmp_path, edit, fragments):
    from automap.plan_schema import PlanFileError

    bad = _edited(saved, tmp_path, edit)
    stored = automap.Plan.load(bad, MESH)  # the structure is fine
    with raises(PlanFileError, str(bad), *fragments):
        stored.build(step, (PARAMS, BATCH))


def test_a_spec_the_mesh_does_not_divide(tmp_path):
    from automap.plan_schema import PlanFileError

    path = tmp_path / "plan.json"
    double = lambda x: x * 2  # noqa: E731
    automap.partition(double, mesh=MESH, search=None).plan(np.ones((6, 4), np.float32)).save(path)
    data = json.load(open(path))
    data["inputs"][0]["spec"] = [["data", "model"], []]
    path.write_text(json.dumps(data))
    with raises(PlanFileError, str(path), "field 'inputs[0].spec[0]'", "dim 0 of size 6", "8 devices", "does not divide"):
        automap.automap(double, mesh=MESH, plan=str(path)).plan(np.ones((6, 4), np.float32))


def test_not_an_object_or_a_string_version(saved, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with raises(PlanMismatchError, str(bad), "not an automap plan file"):
        automap.Plan.load(bad, MESH)
    data = json.load(open(saved[0]))
    data["version"] = "1"
    bad.write_text(json.dumps(data))
    with raises(PlanMismatchError, str(bad), "version '1'", "reads version 1"):
        automap.Plan.load(bad, MESH)
    bad.write_bytes(b"\xff\xfe{")
    with raises(PlanMismatchError, str(bad), "not a plan file"):
        automap.Plan.load(bad, MESH)
