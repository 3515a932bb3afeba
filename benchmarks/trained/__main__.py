"""``python -m benchmarks.trained``: record the traces (see :mod:`benchmarks._lib.trained.record`)."""

from benchmarks._lib.trained.record import main

main()
