"""``python -m lightning_dynmo.gpu_check``: see :mod:`lightning_dynmo.gpu_check.cli`."""

from lightning_dynmo.gpu_check.cli import main

if __name__ == "__main__":
    main()
