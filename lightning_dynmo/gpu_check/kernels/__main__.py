"""``python -m lightning_dynmo.gpu_check.kernels``: see :mod:`lightning_dynmo.gpu_check.kernels.cli`."""

import logging

from lightning_dynmo.gpu_check.kernels.cli import main

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    main()
