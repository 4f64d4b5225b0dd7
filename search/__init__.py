"""Search over the sharding decisions tactics leave open: MCTS, an exact solver, greedy.

>>> import search
>>> sorted(search.__all__)[:3]
['Ceiling', 'Greedy', 'GroupAction']
"""
from search.base import Searcher, SearchResult, SearchStats
from search.ceiling import Ceiling
from search.greedy import Greedy
from search.ilp import ILP, TooLarge
from search.mcts import MCTS, expert_ceiling
from search.space import GroupAction, Score, SearchSpace, TacticAction

__all__ = [
    "Ceiling", "Greedy", "GroupAction", "ILP", "MCTS", "Score", "SearchResult", "SearchSpace", "SearchStats",
    "Searcher", "TacticAction", "TooLarge", "expert_ceiling",
]
