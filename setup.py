"""Build glue that pyproject.toml cannot say: the application's Hydra configuration lives in the top-level
``conf/`` folder (beside ``lightning_dynmo/``, as the project's layout puts it) and ships inside the wheel as
the package ``lightning_dynmo.conf``, so an installed ``dynmo-train`` composes it from any directory.

Everything else (metadata, dependencies, package data) is in pyproject.toml.
"""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["lightning_dynmo", "lightning_dynmo.*"]), "lightning_dynmo.conf"],
    package_dir={"lightning_dynmo.conf": "conf"},
)
