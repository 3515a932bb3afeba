"""The Hydra application behind ``python -m lightning_dynmo.train``: config schemas, launch, report, logging.

Modules, in reading order (:mod:`lightning_dynmo.train` wires them together):

- :mod:`.schema`: structured-config schemas for ``conf/``, generated from the public constructors.
- :mod:`.launch`: who starts the ranks, and where a run writes.
- :mod:`.report`: :class:`RunReport`, the run's summary table and ``summary.json``.
- :mod:`.quiet`: logging (DynMo's lines at INFO on rank 0) and the known-harmless warnings it silences.
- :mod:`.help`: the config groups ``--help`` lists (the user's, not the internal ``schema`` group).

Nothing here is needed to use :class:`~lightning_dynmo.DynMoStrategy` in one's own Trainer; library code
never reads a Hydra config.
"""
