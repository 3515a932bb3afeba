"""Dynamic blocks and controllers for the GPT, one module per case; importing one registers its block kind.

Modules:

- :mod:`.moe`: Mixture of Experts, a block (kind ``"moe"``) whose MLP is experts chosen per token.
- :mod:`.early_exit`: CALM-style early exit (kind ``"early_exit"``), confident tokens leave the model.
- :mod:`.mod`: Mixture of Depths (kind ``"mod"``), a router picks the tokens a block processes.
- :mod:`.sparse_attention`: hash-based block-sparse attention (kind ``"sparse_attention"``).
- :mod:`.sparse_attention_flex`: the active tiles of sparse attention as a FlexAttention block mask.
- :mod:`.tokens`: running a block on some tokens only, what the token-routing cases share.
- :mod:`.pruning`: gradual global magnitude pruning with sparse execution (controller, settings, model).
- :mod:`.pruning_schedule`: Zhu & Gupta's schedule, the sparsity to reach at each optimizer step.
- :mod:`.magnitude_select`: one global magnitude threshold over a model split across ranks.
- :mod:`.pruning_patterns`: which weights prune together: single weights, 2:4 groups or square blocks.
- :mod:`.sparse_linear`: a Linear layer with a pruning mask that can run on a sparse (CSR) kernel.
- :mod:`.freezing`: layer freezing front to back (AutoFreeze-style or on a schedule), no block kind.
"""

from lightning_dynmo.dynamism import early_exit as early_exit
from lightning_dynmo.dynamism import freezing as freezing
from lightning_dynmo.dynamism import mod as mod
from lightning_dynmo.dynamism import moe as moe
from lightning_dynmo.dynamism import pruning as pruning
from lightning_dynmo.dynamism import sparse_attention as sparse_attention
