"""Which import packages the wheel holds, found rather than listed.

Each top-level folder is one import package (pyproject.toml has the rest of the metadata):
proto/lmserve -> lmserve (with lmserve.v1), model/ -> lmserve.model, server/ -> lmserve.server,
client/ -> lmserve.client. Every folder below them ships, so a new subpackage cannot be left out of
the wheel by a forgotten list entry; a folder without an __init__.py (model/native/csrc/) holds
files the code reads, shipped by package-data's file types.
"""

from setuptools import find_namespace_packages, setup

ROOTS = {
    "lmserve": "proto/lmserve",
    "lmserve.model": "model",
    "lmserve.server": "server",
    "lmserve.client": "client",
}


def discovered() -> list[str]:
    found = []
    for package, folder in ROOTS.items():
        found.append(package)
        found += [f"{package}.{sub}" for sub in find_namespace_packages(folder, exclude=["__pycache__", "*.__pycache__"])]
    return sorted(set(found))


setup(packages=discovered(), package_dir=ROOTS)
