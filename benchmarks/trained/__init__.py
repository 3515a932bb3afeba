"""Trained-state measurements: ``python -m benchmarks.trained`` records the traces (its recorder lives in
:mod:`benchmarks._lib.trained`), ``python -m benchmarks.trained.cost_curves`` times a block's cost curves."""
