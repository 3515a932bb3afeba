"""The dynamic-model cases: block kinds that change their own cost while the model trains.

Importing this package registers every kind with the GPT's block registry. One module per case:
``early_exit`` (CALM-style token exit, kind ``"early_exit"``), ``mod`` (Mixture of Depths, kind ``"mod"``);
``tokens`` holds what the token-routing cases share.
"""

from lightning_dynmo.dynamism import early_exit as early_exit
from lightning_dynmo.dynamism import mod as mod
