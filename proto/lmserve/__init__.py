"""lmserve: a compact text-generation inference service."""

__version__ = "0.1.0"
