"""Search over the sharding decisions tactics leave open: MCTS, an exact solver, greedy.

>>> import search
>>> sorted(search.__all__)[:3]
['Greedy', 'GroupAction', 'ILP']
"""
from search.base import SearchResult, SearchStats, Searcher
from search.greedy import Greedy
from search.ilp import ILP, TooLarge
from search.mcts import MCTS
from search.space import GroupAction, Score, SearchSpace, TacticAction

__all__ = [
    "Greedy", "GroupAction", "ILP", "MCTS", "Score", "SearchResult", "SearchSpace", "SearchStats", "Searcher", "TacticAction", "TooLarge",
]
