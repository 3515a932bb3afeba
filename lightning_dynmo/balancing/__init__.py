"""Pure-Python balancing core: layer costs in, placements out.

Nothing in this package imports torch or lightning (a test enforces it), so it can be read, tested
exhaustively and reused on its own.
"""

from lightning_dynmo.balancing.costs import COST_VIEWS, LayerCost, layer_weights
from lightning_dynmo.balancing.placement import Placement

__all__ = ["COST_VIEWS", "LayerCost", "Placement", "layer_weights"]
