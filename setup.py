"""Build of the compiled pieces (Cython); all metadata is in pyproject.toml.

Environment switches (read at build time):

* ``FASTBATCH_DEBUG=1``: bounds-checked debug build (``boundscheck``,
  ``wraparound`` and ``initializedcheck`` on, ``-O0 -g``); for ASan/valgrind.
* ``FASTBATCH_OPT``: optimisation flags, default ``-O3``.
* ``FASTBATCH_ANNOTATE=1``: also write Cython's HTML annotation (``cython -a``).
* ``CFLAGS`` / ``LDFLAGS`` are honoured as usual (e.g. ``-fsanitize=address``).
"""

import os

from Cython.Build import cythonize
from setuptools import Extension, setup

DEBUG = os.environ.get("FASTBATCH_DEBUG", "0") == "1"

# The one place where compiler directives are set.
COMPILER_DIRECTIVES = {
    "language_level": 3,
    "boundscheck": DEBUG,
    "wraparound": DEBUG,
    "initializedcheck": DEBUG,
    "cdivision": True,
    "embedsignature": True,
}

extra_compile_args = (["-O0", "-g3", "-fno-omit-frame-pointer"] if DEBUG
                      else os.environ.get("FASTBATCH_OPT", "-O3").split())

# One extension module per piece (fastbatch/_kernels/<piece>.pyx, named like
# its patch), plus _common, which they all cimport.
extensions = [
    Extension(
        "fastbatch._kernels.*",
        ["fastbatch/_kernels/*.pyx"],
        include_dirs=["fastbatch/_kernels"],
        depends=["fastbatch/_kernels/_pylong.h", "fastbatch/_kernels/_common.pxd",
                 "fastbatch/_kernels/_prefetch.h", "fastbatch/_kernels/_prefetch.pxd",
                 "fastbatch/_kernels/_ndarray.h"],
        extra_compile_args=extra_compile_args,
        undef_macros=["NDEBUG"] if DEBUG else [],
    )
]

setup(
    ext_modules=cythonize(
        extensions,
        compiler_directives=COMPILER_DIRECTIVES,
        force=DEBUG,  # the C file may come from a build with other directives
        annotate=os.environ.get("FASTBATCH_ANNOTATE", "0") == "1",
    )
)
