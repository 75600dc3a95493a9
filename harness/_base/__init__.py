"""The base every wing stands on: value kinds, frames, process ids, other libraries'
internals and the version. It imports nothing of harness.
"""
