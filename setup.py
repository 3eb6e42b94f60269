"""Package discovery. The metadata is in pyproject.toml; this file only lists the packages,
because setuptools' pyproject ``packages.find`` cannot also add a package that ``package-dir``
maps from another folder (the top-level sample_data/ shipped as napari_gpuseg._sample_data)."""
from setuptools import find_namespace_packages, setup

setup(packages=find_namespace_packages(include=["napari_gpuseg*"], exclude=["*.__pycache__"])
      + ["napari_gpuseg._sample_data"])
