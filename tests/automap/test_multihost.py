"""Multi-host: two processes on this machine (4 simulated CPU devices each, gloo collectives over
127.0.0.1) plan and run zoo train steps on one global 2x4 mesh; both must get the single-process
losses and state, with host arrays and with global arrays as inputs.

The workers are ``tests/automap/multihost_worker.py``; each prints JSON records on stdout.
"""
import json
import os
import socket
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tests", "automap", "multihost_worker.py")
TIMEOUT_S = 120
CASES = ("mlp/batch", "mlp/search", "mlp/dp+megatron", "gpt/dp+megatron")
MODES = ("host", "global")
MARKER = "@automap-multihost "  # the worker's records: MARKER + JSON on a line of its own


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(modes: str, n: int = 2) -> list[list[dict]]:
    """Start ``n`` workers, wait at most TIMEOUT_S for all of them (kill on timeout), return the
    JSON records each printed."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0"  # 4 local devices
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    for k in ("JAX_NUM_CPU_DEVICES", "JAX_COORDINATOR_ADDRESS", "JAX_PROCESS_ID", "JAX_NUM_PROCESSES"):
        env.pop(k, None)
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, WORKER, str(i), str(port), modes], cwd=ROOT, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for i in range(n)
    ]
    deadline = time.monotonic() + TIMEOUT_S
    outputs = []
    try:
        for p in procs:
            try:
                outputs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                pytest.fail(f"multi-host worker did not finish within {TIMEOUT_S} s")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    records = []
    for i, (p, (out, err)) in enumerate(zip(procs, outputs, strict=True)):
        noise = "\n".join(line for line in err.splitlines() if "[Gloo]" not in line)
        assert p.returncode == 0, f"worker {i} exited with {p.returncode}:\n{out}\n{noise[-4000:]}"
        records.append([json.loads(line[line.index(MARKER) + len(MARKER):]) for line in out.splitlines() if MARKER in line])
    return records


@pytest.fixture(scope="module")
def results():
    return launch(",".join(MODES))


def test_both_processes_join_one_cluster(results):
    infos = [next(r["info"] for r in recs if "info" in r) for recs in results]
    assert sorted(i["process_id"] for i in infos) == [0, 1]
    for info in infos:
        assert info["process_count"] == 2
        assert info["device_count"] == 8 and info["local_device_count"] == 4
    assert all({"done": True} in recs for recs in results)


def _case(recs: list[dict], name: str) -> dict:
    (rec,) = [r for r in recs if r.get("case") == name]
    return rec


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES)
def test_every_process_gets_the_single_process_result(results, case, mode):
    for pid, recs in enumerate(results):
        rec = _case(recs, case)
        got, want = rec[mode]["losses"], rec["ref_losses"]
        assert len(got) == len(want) == 3
        for a, b in zip(got, want, strict=True):
            assert abs(a - b) <= 1e-5 + 1e-5 * abs(b), f"process {pid} {case} {mode}: losses {got}, unsharded {want}"
        # the trained state after three steps: allclose(rtol=1e-5, atol=1e-5) to the unsharded one
        assert rec[mode]["state_err"] <= 1.0, f"process {pid} {case} {mode}: state differs ({rec[mode]['state_err']})"
        # the new state comes back in the plan's layout (the next step does not reshard)
        assert rec[mode]["state_in_plan_layout"], f"process {pid} {case} {mode}"
    # both processes computed the same plan and the same losses, independently
    a, b = (_case(recs, case) for recs in results)
    assert a["in_specs"] == b["in_specs"]
    assert a[mode]["losses"] == b[mode]["losses"]


def test_global_arrays_in_another_layout_are_resharded(results):
    for recs in results:
        # megatron's layout differs from the replicated state / row-split batch the worker built
        rec = _case(recs, "gpt/dp+megatron")
        assert rec["global"]["inputs_global"] and rec["global"]["inputs_resharded"] > 0
        assert any("model" in s for s in rec["in_specs"])
        # the batch plan is exactly the layout built: nothing to reshard
        rec = _case(recs, "mlp/batch")
        assert rec["global"]["inputs_global"] and rec["global"]["inputs_resharded"] == 0
        assert not rec["host"]["inputs_global"]
