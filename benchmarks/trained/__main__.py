"""``python -m benchmarks.trained``: see :mod:`benchmarks.trained.record`."""

from benchmarks.trained.record import main

main()
