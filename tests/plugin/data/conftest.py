# Files here are a downstream project's sources that tests copy into pytester's folders:
# data, not tests of this repository (they import their own neighbours as top-level modules).
collect_ignore_glob = ["*.py"]
