"""The Hydra application behind ``python -m lightning_dynmo.train``: config schemas, launch, report, logging.

Read in this order: :mod:`~lightning_dynmo.app.schema` (the structured configs Hydra validates
``conf/`` against, generated from the public constructors), :mod:`~lightning_dynmo.app.launch` (who
starts the ranks, and where a run writes), :mod:`~lightning_dynmo.app.report` (the per-run summary
table and ``summary.json``), :mod:`~lightning_dynmo.app.quiet` (logging and the few known-harmless
warnings it silences). :mod:`lightning_dynmo.train` wires them together.

Nothing here is needed to use :class:`~lightning_dynmo.DynMoStrategy` in one's own Trainer; library code
never reads a Hydra config.
"""
