"""Issue 17's headline case measured: the pure-JAX Llama of ``tests/automap/test_llama_rotary.py``
(rotary embedding written with ``jnp.stack``, 2 layers) under the zoo's Adam train step, mesh
data=2 x model=4 on 8 simulated CPU devices. Per plan (the default search, data parallel, data
parallel + Megatron): the estimated step time, bytes sent and memory per device against XLA's
measure of the compiled program, and the missing-rule warnings (none expected).

    python benchmarks/llama_rotary.py
"""
import os
import sys
import time
import warnings

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
import _isolate  # noqa: E402,F401  (first: keeps benchmarks/search.py from shadowing the package)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "automap"))
import test_llama_rotary as llama  # noqa: E402  (the model the test checks)

import automap  # noqa: E402
import tactics  # noqa: E402
from automap.rules import MissingRuleWarning  # noqa: E402
from automap.zoo import make_optimizer, make_train_step  # noqa: E402

PLANS = {
    "default search": {},
    "data_parallel": dict(tactics=[tactics.data_parallel("data")], search=None),
    "data_parallel + megatron": dict(
        tactics=[tactics.schedule(tactics.data_parallel("data"), tactics.megatron("model"))], search=None),
}


def main() -> None:
    params, batch = llama.init()
    optimizer = make_optimizer(1e-2)
    state = {"params": params, "opt_state": optimizer.init(params)}
    step = make_train_step(llama.loss_fn, optimizer)
    print("| plan | est. step | est. bytes sent | XLA bytes sent | est. memory | XLA memory | missing rules | s |")
    print("|---|---|---|---|---|---|---|---|")
    for name, options in PLANS.items():
        start = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            partitioned = automap.automap(step, mesh=llama.MESH, **options)
            estimate = partitioned.plan(state, batch).estimate
            measured = automap.measure(partitioned.lower(state, batch).compile())
        missing = sum(issubclass(w.category, MissingRuleWarning) for w in caught)
        print(f"| {name} | {estimate.time_s * 1e3:.3f} ms | {estimate.wire_bytes:,.0f} | {measured.wire_bytes:,.0f} | "
              f"{estimate.peak_memory_bytes:,} | {measured.memory_per_device:,} | {missing} | "
              f"{time.perf_counter() - start:.0f} |", flush=True)


if __name__ == "__main__":
    main()
