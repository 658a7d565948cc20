"""Build of the optional C kernels; everything else is declared in pyproject.toml.

The extension is optional: where no C compiler or Python headers are available the install
goes on without it and ppokit uses the pure-PyTorch scan (ppokit/_native.py).
"""

import sys

from setuptools import Extension, setup

flags = [] if sys.platform == "win32" else ["-O3"]

setup(
    ext_modules=[
        Extension(
            "ppokit._kernels",
            ["ppokit/_kernels.c"],
            extra_compile_args=flags,
            optional=True,
        )
    ]
)
