"""What a pipelined model is: the contract it follows and the units DynMo cuts it into.

- :mod:`.contract`: what a LightningModule exposes (``layers``, first/last parts, the stage interface).
- :mod:`.units`: its units (blocks and first/last parts) by global name: list, detach, attach.
- :mod:`.construction`: each rank builds and initialises only the units it owns, seeded per unit.
- :mod:`.unit_state`: what of a unit can migrate (user hooks refused, parametrizations rebuilt).
- :mod:`.compiled`: blocks compiled one by one (``compile_blocks``), hooks and names outside compiled code.
- :mod:`.ties`: parameters the first and last parts share (a tied embedding and head) across two ranks.
"""
