"""Dynamic blocks for the GPT, one module per case; importing a module registers its block kind."""

from lightning_dynmo.dynamism import moe  # noqa: F401, I001  # registers "moe" (MoEOptions)
from lightning_dynmo.dynamism import pruning  # noqa: F401  # gradual global magnitude pruning (no block kind)
