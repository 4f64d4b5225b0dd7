"""Search over the sharding decisions tactics leave open: MCTS (a chain of stages around tree
search, :mod:`search.stages`), an exact solver, greedy; one objective orders plans for all of them.

>>> import search
>>> [s.name for s in search.MCTS().stages().stages]
['compose', 'tree', 'polish', 'repair', 'sweep', 'polish', 'refine', 'tie']
"""
from search.base import Searcher, SearchResult, SearchStats
from search.ceiling import Ceiling
from search.compose import compositions, expert_ceiling
from search.greedy import Greedy
from search.ilp import ILP, TooLarge
from search.mcts import MCTS
from search.objective import Objective
from search.space import GroupAction, Plan, Score, SearchSpace, TacticAction
from search.stages import Chain, ChainSearch, Found, chain

__all__ = [
    "Ceiling", "Chain", "ChainSearch", "Found", "Greedy", "GroupAction", "ILP", "MCTS", "Objective", "Plan", "Score", "SearchResult",
    "SearchSpace", "SearchStats", "Searcher", "TacticAction", "TooLarge", "chain", "compositions", "expert_ceiling",
]
