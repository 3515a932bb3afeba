"""One training or evaluation step through the pipeline, on torch's pipeline schedules.

- :mod:`.stage`: the module one stage runs and how the stage interface reaches its blocks.
- :mod:`.schedule`: build this rank's stages and one torch schedule, and run a step.
- :mod:`.lowering`: torch's multi-stage schedules with their compute + comms lowering looked up, so a
  migration's rebuild does not lower the same lists again.
- :mod:`.boundaries`: what crosses each layer boundary, recorded once, so a migration's new stages skip
  torch's metadata pass.
- :mod:`.actions`: each rank's ordered compute actions under a schedule, read from torch's schedules.
- :mod:`.microbatches`: the micro-batch count a pipeline runs (configured, or re-tuned by a re-pack).
- :mod:`.aux_loss`: auxiliary losses from any block or part, their gradient applied where they arise.
- :mod:`.recompute`: activation checkpointing of blocks (forward run again in backward, counted once).
- :mod:`.gradless`: stages behind a frozen prefix keep their weight gradients in split backward.
- :mod:`.grads`: a step's gradients handed to Lightning's automatic optimization and reduced across ranks.
- :mod:`.loss_scaling`: fp16 loss scaling across the pipeline (ranks skip overflowing steps together).
- :mod:`.evaluation`: forward-only pipelined validation and test losses.
"""
