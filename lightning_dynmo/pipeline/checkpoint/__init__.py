"""Placement-independent checkpoints: any placement or number of ranks reads what any other wrote.

- :mod:`.contents`: what a DynMo Lightning checkpoint holds, and how a rank writes and reads its share.
- :mod:`.state`: every unit's tensors and optimizer state keyed by global name (gather, merge, load locally).
- :mod:`.sharded`: sharded directories written with ``torch.distributed.checkpoint``; export to one file.
- :mod:`.resume`: the checkpoint to resume from; an incomplete ``last*.ckpt`` skipped, with a warning.
- :mod:`.atomic`: a save replaces the old checkpoint only once it is complete; interrupted saves repaired.
- :mod:`.checksums`: CRC-32 checksums written with every checkpoint and verified on load.
- :mod:`.renaming`: rename a checkpoint's parameter keys (model state and name-keyed optimizer state).
"""
