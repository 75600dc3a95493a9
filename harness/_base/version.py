"""The harness's version, in a leaf module so that any module may name it."""

__version__ = "0.2.0"
