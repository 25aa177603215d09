"""Packages for setuptools (the rest of the metadata is in pyproject.toml).

The repository keeps its layers as top-level folders (app, bench and training -> engine -> kernels, and assets); installed,
each becomes a subpackage of the one package `moedesk`, so nothing else lands in site-packages.
"""
from setuptools import find_packages, setup

LAYERS = ("app", "bench", "training", "engine", "kernels", "assets")
inner = find_packages(include=[f"{layer}{tail}" for layer in LAYERS for tail in ("", ".*")])
setup(
    packages=["moedesk"] + [f"moedesk.{name}" for name in inner],
    package_dir={"moedesk": "moedesk", **{f"moedesk.{layer}": layer for layer in LAYERS}},
)
