"""Inductive tactics: rules that recognise structure in the IR and shard it, composed in order."""
from tactics.base import PlanContext, Tactic, TacticResult, run_schedule
from tactics.batch import batch_over_all_axes
from tactics.manual import manual

__all__ = ["PlanContext", "Tactic", "TacticResult", "batch_over_all_axes", "manual", "run_schedule"]
