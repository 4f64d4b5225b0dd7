"""One process of the multi-host test (``tests/automap/test_multihost.py`` starts two of them).

    python tests/automap/multihost_worker.py <process_id> <port> <modes>

Each process joins a 2-process JAX cluster on 127.0.0.1:<port> with 4 simulated CPU devices
(the parent sets ``XLA_FLAGS=--xla_force_host_platform_device_count=4``), builds the global 2x4
mesh over ``jax.devices()`` (8 devices) and runs zoo train steps through automap in each of the
comma-separated ``<modes>``:

- ``host``: every process passes the same host (NumPy) arrays; automap places them.
- ``global``: every process builds global ``jax.Array``s itself (the batch from its own rows with
  ``jax.make_array_from_process_local_data``, the state replicated) in a layout of its own;
  automap reshards what differs from the plan.

Each case plans once, runs three steps per mode (feeding the new state back in) and reports the
losses and the distance of the final state to an unsharded ``jax.jit`` of the same step on this
process's first local device: one JSON record per case on stdout (``{"case": ...}``), then
``{"done": true}``, each on a line of its own after the marker ``MARKER`` (gloo logs on stdout too).
"""
from __future__ import annotations

import json
import os
import sys

import jax

STEPS = 3
MARKER = "@automap-multihost "


def emit(record: dict) -> None:
    print(MARKER + json.dumps(record), flush=True)  # one write: not interleaved with gloo's logs


def _init(process_id: int, port: int) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id,
        initialization_timeout=60,
    )


def _workloads():
    from automap import zoo

    mlp = zoo.mlp(zoo.MLPConfig(d_in=16, hidden=(32,), d_out=8, batch=8))
    gpt = zoo.gpt_linen(zoo.GPTConfig(layers=1, d_model=32, heads=4, vocab=64, seq=8, batch=8))
    return {"mlp": mlp, "gpt": gpt}


def _schedules():
    import tactics

    return {  # keyword arguments of automap.automap
        "batch": {"search": None},  # no search: the batch over every mesh axis
        "search": {},  # the default: MCTS, which every process must run to the same plan
        "dp+megatron": {"tactics": [tactics.data_parallel("data"), tactics.megatron("model")]},
    }


CASES = (("mlp", "batch"), ("mlp", "search"), ("mlp", "dp+megatron"), ("gpt", "dp+megatron"))


def _host(tree):
    import numpy as np

    return jax.tree.map(lambda x: np.array(x), tree)


def _gather(tree):
    """Host copies of (possibly cross-process) global arrays."""
    import numpy as np
    from jax.experimental import multihost_utils

    def one(x):
        if x.is_fully_addressable or x.is_fully_replicated:
            return np.asarray(x)
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree.map(one, tree)


def _global_inputs(mesh, state, batch):
    """Global arrays built by this process: the state replicated, the batch split by rows over
    all devices (each process supplies only its own rows)."""
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    replicated = NamedSharding(mesh, P())
    rows = NamedSharding(mesh, P(tuple(mesh.axis_names)))
    g_state = jax.tree.map(lambda x: jax.make_array_from_callback(x.shape, replicated, lambda idx: x[idx]), state)

    def local_rows(x):
        n = x.shape[0] // jax.process_count()
        mine = x[jax.process_index() * n : (jax.process_index() + 1) * n]
        return jax.make_array_from_process_local_data(rows, np.ascontiguousarray(mine), x.shape)

    return g_state, jax.tree.map(local_rows, batch)


def _close(got, want) -> float:
    """max |got - want| / (atol + rtol |want|) over all leaves (<= 1: allclose at rtol=atol=1e-5)."""
    import numpy as np

    return max(
        float(np.max(np.abs(a - b) / (1e-5 + 1e-5 * np.abs(b)), initial=0.0))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
    )


def run_case(mesh, workload, options, modes) -> dict:
    """Plan once, then run STEPS steps from the same initial state in each input style."""
    import automap

    state, batch = (_host(t) for t in workload.init(0))
    # the single-process reference: an unsharded jit on this process's first device
    ref_step = jax.jit(workload.train_step)
    ref_state, ref_batch = jax.device_put((state, batch), jax.local_devices()[0])
    ref_losses = []
    for _ in range(STEPS):
        ref_state, loss = ref_step(ref_state, ref_batch)
        ref_losses.append(float(loss))
    ref_state = _host(ref_state)

    step = automap.automap(workload.train_step, mesh=mesh, **options)
    plan = step.plan(state, batch)  # computed here, from the function and shapes alone
    want = jax.tree.leaves(plan.in_shardings)
    out = {"ref_losses": ref_losses, "in_specs": [str(s.spec) for s in want]}
    for mode in modes:
        cur_state, cur_batch = (state, batch) if mode == "host" else _global_inputs(mesh, state, batch)
        given = jax.tree.leaves((cur_state, cur_batch))
        resharded = sum(isinstance(x, jax.Array) and not x.sharding.is_equivalent_to(s, x.ndim) for x, s in zip(given, want))
        losses, fed_back_ok = [], True
        for _ in range(STEPS):
            cur_state, loss = step(cur_state, cur_batch)
            losses.append(float(loss))  # a replicated scalar: readable on every process
            fed_back_ok &= all(
                x.sharding.is_equivalent_to(s, x.ndim)
                for x, s in zip(jax.tree.leaves(cur_state), jax.tree.leaves(plan.in_shardings[0]), strict=True)
            )
        out[mode] = {
            "losses": losses,
            "state_err": _close(_gather(cur_state), ref_state),
            "state_in_plan_layout": bool(fed_back_ok),
            "inputs_resharded": int(resharded),
            "inputs_global": all(isinstance(x, jax.Array) and not x.is_fully_addressable for x in given),
        }
    return out


def main(argv: list[str]) -> int:
    process_id, port = int(argv[1]), int(argv[2])
    modes = argv[3].split(",")
    assert set(modes) <= {"host", "global"}, modes
    _init(process_id, port)
    import automap

    info = {
        "process_id": jax.process_index(), "process_count": jax.process_count(),
        "device_count": jax.device_count(), "local_device_count": jax.local_device_count(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }
    emit({"info": info})
    mesh = automap.make_mesh({"data": 2, "model": 4})  # over jax.devices(): all 8, both processes
    workloads, schedules = _workloads(), _schedules()
    for wname, sname in CASES:
        result = run_case(mesh, workloads[wname], schedules[sname], modes)
        emit({"case": f"{wname}/{sname}", **result})
    emit({"done": True})
    jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
