"""Megatron-LM sharding benchmark (expert plans vs automap's search on GPT-2 shaped models).

    python benchmarks/megatron.py [--quick] [--out DIR]     # same as: python -m automap bench megatron

The code lives in :mod:`automap.bench_megatron` so that ``python -m automap bench megatron`` works
from an installed package; see its docstring for the configurations, meshes and strategies.
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
import _isolate  # noqa: E402,F401  (first: keeps benchmarks/search.py from shadowing the package)

from automap.bench_megatron import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
