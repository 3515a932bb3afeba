"""``python -m lightning_dynmo.gpu_check.kernels``: what each dynamism's kernels cost on a GPU, in one run.

Read in this order: :mod:`.timing` (the shapes and the interleaved fwd+bwd timer), :mod:`.parts` (the
measurements: sparse attention, pruning kernels, MoD / early-exit stalls, MoE experts, cost curves),
then :mod:`.cli` (the command, its budget and the JSON it writes) and :mod:`.curves` (the cost curves
read back, for the projection and the replay).

Every figure is real compute on the device the command ran on (labelled ``"real compute"`` in the JSON),
timed forward + backward with interleaved rounds (each round runs every variant once, so a change of
load hits all alike), reported as medians with every round. A part that fails records its error and
the run goes on; parts run most important first, and once the budget is spent the rest are recorded as
skipped, so the command ends in time (under 8 minutes on one H100/H200, the machine's start aside).
"""
