"""Dynamic blocks for the GPT, one module per case; importing a module registers its block kind."""

from lightning_dynmo.dynamism import moe  # noqa: F401  # registers "moe" (MoEOptions)
from lightning_dynmo.dynamism import sparse_attention as sparse_attention  # registers "sparse_attention"
