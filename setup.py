"""Build script: only the Cython extensions live here; everything else is in pyproject.toml."""
from Cython.Build import cythonize
from setuptools import Extension, setup

extensions = [
    Extension(
        "pipeload._fastio",
        ["pipeload/_fastio.pyx"],
        depends=["pipeload/_guard.h"],
        extra_compile_args=["-O3"],
    ),
    Extension("pipeload._greedy", ["pipeload/_greedy.pyx"], extra_compile_args=["-O3"]),
    Extension("pipeload._leafplan", ["pipeload/_leafplan.pyx"], extra_compile_args=["-O3"]),
]

setup(
    ext_modules=cythonize(
        extensions,
        language_level=3,
        compiler_directives={"boundscheck": False, "wraparound": False, "cdivision": True},
    )
)
