"""Search over the sharding decisions tactics leave open (MCTS, exact ILP, greedy): coming next."""

__all__: list[str] = []
