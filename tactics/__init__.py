"""Inductive tactics: rules that recognise structure in the IR and shard it, composed in order.

>>> import tactics
>>> [t.name for t in (tactics.data_parallel("data"), tactics.megatron("model"))]
['data_parallel', 'megatron']
"""
from tactics.base import PlanContext, Schedule, Tactic, TacticResult, run_schedule, schedule
from tactics.batch import batch_over_all_axes
from tactics.context_parallel import context_parallel
from tactics.data_parallel import data_parallel
from tactics.expert_parallel import expert_parallel
from tactics.fsdp import StateRoles, Zero, fsdp, state_roles, zero
from tactics.logical import logical
from tactics.manual import manual
from tactics.megatron import megatron
from tactics.recompute import recompute
from tactics.sequence_parallel import sequence_parallel
from tactics.presets import fsdp_only, fsdp_tp, megatron_dp, zero_dp

__all__ = [
    "PlanContext", "Schedule", "StateRoles", "Tactic", "TacticResult", "Zero", "batch_over_all_axes", "context_parallel",
    "data_parallel",
    "expert_parallel", "fsdp", "fsdp_only", "fsdp_tp", "logical", "manual", "megatron", "megatron_dp", "recompute",
    "run_schedule",
    "schedule", "sequence_parallel", "state_roles", "zero", "zero_dp",
]
