"""The estimate against XLA on one device of the local backend (nothing sharded: a GPU's own
compiler and fusions, where there is one): per corpus model and a GPT-2-small-like zoo GPT
(4 layers, batch 8 x 1024), the default plan's memory per device and dot FLOPs, estimated /
measured (``automap.measure``: on XLA:GPU its cuBLAS and cuDNN calls count as dot FLOPs).

    python benchmarks/one_device.py [--models linen_resnet,gpt2_small_l4]
"""
import argparse

import _isolate  # noqa: F401  (first: keeps benchmarks/search.py from shadowing the package)

import jax

import automap
from automap import zoo
from automap.measure import measure
from automap.zoo import corpus


def main() -> None:
    models = dict(corpus.BUILDERS)
    models["gpt2_small_l4"] = lambda: zoo.gpt_linen(zoo.GPTConfig(layers=4, d_model=768, heads=12, seq=1024,
                                                                   vocab=50304, batch=8))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(models))
    a = ap.parse_args()
    print(f"jax {jax.__version__}, {jax.default_backend()} ({jax.devices()[0].device_kind}), one device", flush=True)
    mesh = automap.make_mesh({"data": 1})
    for name in a.models.split(","):
        w = models[name]()
        step = automap.automap(w.train_step, mesh=mesh)
        plan = step.plan(*w.abstract())
        m = measure(step.lower(*w.abstract()).compile())
        est = plan.estimate
        print(f"{name:<16} memory est/XLA {est.memory.peak / m.memory_per_device:.3f} "
              f"({est.memory.peak} / {m.memory_per_device} B); dot FLOPs est/XLA {est.dot_flops / max(m.dot_flops, 1):.3f}",
              flush=True)


if __name__ == "__main__":
    main()
