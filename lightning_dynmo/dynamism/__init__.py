"""Dynamic blocks for the GPT, one module per case; importing a module registers its block kind.

``moe`` (Mixture of Experts, kind ``"moe"``), ``early_exit`` (CALM-style token exit, kind
``"early_exit"``), ``mod`` (Mixture of Depths, kind ``"mod"``); ``tokens`` holds what the token-routing
cases share.
"""

from lightning_dynmo.dynamism import early_exit as early_exit
from lightning_dynmo.dynamism import mod as mod
from lightning_dynmo.dynamism import moe  # noqa: F401  # registers "moe" (MoEOptions)
