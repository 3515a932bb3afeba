"""Live migration of units between ranks, with everything that belongs to them.

- :mod:`.transport`: the moves all ranks agree on, and the exchange that carries units between ranks.
- :mod:`.pack`: one unit as a pickled structure plus tensor payloads, and back.
- :mod:`.optimizer`: a migrated unit's parameters leave one rank's optimizers and join another's, in order.
- :mod:`.param_groups`: the optimizer parameter group a migrated parameter joins; LR schedulers in step.
"""
