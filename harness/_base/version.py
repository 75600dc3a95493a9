"""The harness's version, in a leaf module so that any module may name it."""

#: the harness's version (PEP 440)
__version__ = "0.2.0"
