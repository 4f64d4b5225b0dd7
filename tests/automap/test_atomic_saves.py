"""Overwriting a checkpoint (save(..., force=True)) or a plan file (Plan.save) is atomic: a process
killed at any moment leaves the old or the new one, readable and whole (automap.atomic)."""
import os
import random
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import automap
from automap import atomic, checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "atomic_save_worker.py")
MESH2 = automap.make_mesh({"data": 2})
DELAYS_S = (0.0, 0.17)  # after the first save (saves take ~0.05-0.1 s); every step of the swap: below


def _restored_w(path):
    return np.asarray(checkpoint.restore(path, NamedSharding(MESH2, P()))["w"])


def test_killed_while_saving_leaves_the_old_or_the_new(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    folders, procs = [], []
    for i, _ in enumerate(DELAYS_S):  # side by side: one jax start-up's wall time for all
        folders.append(tmp_path / str(i))
        folders[-1].mkdir()
        procs.append(subprocess.Popen([sys.executable, WORKER, str(folders[-1])], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    lines = []
    for proc, delay in zip(procs, DELAYS_S, strict=True):
        for line in proc.stdout:
            if line.strip() == "ready":
                break
        else:
            pytest.fail(f"the worker stopped before its first save: {proc.stderr.read()[-2000:]}")
        time.sleep(delay + random.Random(delay).uniform(0, 0.05))
        proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate()
        lines.append(out.split())
    for folder, out in zip(folders, lines, strict=True):
        done = max(int(w) for w in out if w.isdigit()) if any(w.isdigit() for w in out) else 0
        w = _restored_w(str(folder / "ckpt"))
        assert w.tolist() in ([float(done)] * 4, [float(done + 1)] * 4), (done, w)
        text = (folder / "plan.json").read_text()
        refs = [(folder / f"{n}.json").read_text() for n in "ab"]
        # the plan saved with checkpoint `done` or the next one
        assert text in (refs[done % 2], refs[(done + 1) % 2])
        assert automap.Plan.load(str(folder / "plan.json"), MESH2).data["format"] == "automap-plan"
        leftovers = [n for n in os.listdir(folder) if n not in ("a.json", "b.json", "plan.json", "ckpt")]
        assert all(n.startswith((".plan.json.", "ckpt.")) for n in leftovers), leftovers
        # the next save cleans up what the killed one left
        checkpoint.save(str(folder / "ckpt"), {"w": np.full((4,), -1.0, np.float32)}, force=True)
        assert _restored_w(str(folder / "ckpt")).tolist() == [-1.0] * 4
        assert not [n for n in os.listdir(folder) if n.startswith("ckpt.")]


class Crash(Exception):
    pass


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "two-renames"])
@pytest.mark.parametrize("crash_at", range(4))
def test_a_crash_at_each_step_of_the_swap(tmp_path, monkeypatch, exchange, crash_at):
    """Every file system call of the swap fails in turn: the checkpoint read back is the old or the new."""
    path = str(tmp_path / "ckpt")
    checkpoint.save(path, {"w": np.zeros(4, np.float32)})
    if not exchange:
        monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    calls = []

    def failing(real):
        def call(*args, **kwargs):
            calls.append(real.__name__)
            if len(calls) > crash_at:
                raise Crash(real.__name__)
            return real(*args, **kwargs)
        return call

    for name in ("rename",):
        monkeypatch.setattr(atomic.os, name, failing(getattr(os, name)))
    monkeypatch.setattr(atomic.shutil, "rmtree", failing(atomic.shutil.rmtree))
    if exchange:
        monkeypatch.setattr(atomic, "_exchange", failing(atomic._exchange))
    try:
        checkpoint.save(path, {"w": np.ones(4, np.float32)}, force=True)
        crashed = False
    except Crash:
        crashed = True
    monkeypatch.undo()
    assert _restored_w(path).tolist() in ([0.0] * 4, [1.0] * 4)
    if not crashed:
        assert _restored_w(path).tolist() == [1.0] * 4
    checkpoint.save(path, {"w": np.full(4, 2.0, np.float32)}, force=True)  # and the next save works
    assert _restored_w(path).tolist() == [2.0] * 4


def test_a_crash_while_writing_keeps_the_old(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt")
    checkpoint.save(path, {"w": np.zeros(4, np.float32)})
    monkeypatch.setattr(checkpoint, "replace_directory", lambda new, p: (_ for _ in ()).throw(Crash()))
    with pytest.raises(Crash):
        checkpoint.save(path, {"w": np.ones(4, np.float32)}, force=True)
    assert _restored_w(path).tolist() == [0.0] * 4


def test_existing_checkpoint_without_force(tmp_path):
    path = str(tmp_path / "ckpt")
    checkpoint.save(path, {"w": np.zeros(4, np.float32)})
    with pytest.raises(FileExistsError, match="force=True"):
        checkpoint.save(path, {"w": np.ones(4, np.float32)})
    assert _restored_w(path).tolist() == [0.0] * 4


def test_plan_save_replaces_the_file_whole(tmp_path, monkeypatch):
    import jax.numpy as jnp

    path = tmp_path / "plan.json"
    plan = automap.partition(jnp.tanh, mesh=MESH2).plan(jnp.ones((8, 4)))
    path.write_text("old")
    monkeypatch.setattr(atomic.os, "replace", lambda a, b: (_ for _ in ()).throw(Crash()))
    with pytest.raises(Crash):
        plan.save(path)
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["plan.json"]  # the temporary file is gone
    monkeypatch.undo()
    plan.save(path)
    assert automap.Plan.load(path, MESH2, jnp.tanh, (jnp.ones((8, 4)),)).in_shardings[0] == plan.in_shardings[0]


def test_without_orbax_the_error_names_the_extra(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_orbax(name, *args, **kwargs):
        if name.startswith("orbax"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_orbax)
    with pytest.raises(ImportError, match=re.escape("pip install 'automap[checkpoint]'")):
        checkpoint.save(str(tmp_path / "ckpt"), {"w": np.zeros(4, np.float32)})
