"""A GPU check: DynMo's CUDA paths run end to end in minutes, and what they measured lands in one JSON file.

``python -m lightning_dynmo.gpu_check`` (``--dry-run``: the same parts, tiny, on CPU/gloo in about a minute).
Every part runs in its own process group under a timeout, so a hung NCCL call or a crash is recorded in the
file and the check goes on; the whole check stops starting parts when its time budget is spent.

Modules:

- :mod:`.cli`: the command line, the order of the parts and the JSON report.
- :mod:`.plan`: the sizes (realistic on GPU, tiny in the dry run) and the parts to run on this machine.
- :mod:`.runner`: one part in a child process under a timeout; its result, or its error and log tail.
- :mod:`.worker`: the child's entry point (``python -m lightning_dynmo.gpu_check.worker``).
- :mod:`.training`: training under ``DynMoStrategy`` with mixed precision, and per-layer costs per case.
- :mod:`.stalls`: which steps stall when a block's shapes change every step (MoD, early exit), and why.
- :mod:`.migration`: a migration of device tensors between two processes, and the NCCL one-device probe.
- :mod:`.hardware`: the machine, named: device, memory, torch / CUDA / NCCL versions.
- :mod:`.kernels`: the kernel check (``python -m lightning_dynmo.gpu_check.kernels``): what each case's
  kernel saves at the paper's GPT shape, and the cost curves.
"""
