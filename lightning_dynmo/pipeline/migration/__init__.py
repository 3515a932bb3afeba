"""Live migration of units between ranks, with everything that belongs to them.

- :mod:`.transport`: the moves all ranks agree on, and the exchange that carries units between ranks.
- :mod:`.param_groups`: the optimizer parameter group a migrated parameter joins; LR schedulers in step.
"""
