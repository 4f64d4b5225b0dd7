"""Small models used by the demo, tests and benchmarks: GPT (linen and nnx), MLP, expert plans.

Every constructor returns a `Workload` with a pure ``train_step(state, batch) -> (state, loss)``.

>>> from automap import zoo
>>> w = zoo.gpt_linen(zoo.GPTConfig(layers=2, scan=True))
>>> w.name
'gpt_linen_l2_scan'
>>> state, batch = w.abstract()
>>> batch["tokens"].shape
(8, 16)
"""

from automap.zoo import experts
from automap.zoo.branches import BranchesConfig, branches
from automap.zoo.gpt_linen import gpt_linen
from automap.zoo.gpt_nnx import gpt_nnx
from automap.zoo.mlp import MLPConfig, mlp
from automap.zoo.train import make_optimizer, make_train_step
from automap.zoo.workload import GPTConfig, Workload

__all__ = [
    "BranchesConfig",
    "GPTConfig",
    "MLPConfig",
    "Workload",
    "branches",
    "experts",
    "gpt_linen",
    "gpt_nnx",
    "make_optimizer",
    "make_train_step",
    "mlp",
]
