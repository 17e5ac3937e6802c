"""The one compiled part: the lookup plane's index reads and inserts (kvtier/_index_native.c).

Optional: where it cannot be built (no C compiler), kvtier installs without it and its index
uses numpy, about ten times slower a lookup and twice a publish (`kvtier.key_index`).
Everything else is declared in pyproject.toml.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvtier._index_native", ["kvtier/_index_native.c"],
                             optional=True, extra_compile_args=["-O2"])])
