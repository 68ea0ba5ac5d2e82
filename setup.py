"""Build script: only the Cython extensions live here; everything else is in pyproject.toml."""
from Cython.Build import cythonize
from setuptools import Extension, setup

extensions = [
    Extension(
        "pipeload.io._fastio",
        ["pipeload/io/_fastio.pyx"],
        depends=["pipeload/io/_guard.h"],
        extra_compile_args=["-O3"],
    ),
    Extension("pipeload.formats._memoprune", ["pipeload/formats/_memoprune.pyx"], extra_compile_args=["-O3"]),
    Extension("pipeload.plan._greedy", ["pipeload/plan/_greedy.pyx"], extra_compile_args=["-O3"]),
    Extension("pipeload.plan._leafplan", ["pipeload/plan/_leafplan.pyx"], extra_compile_args=["-O3"]),
    Extension("pipeload.move._regions", ["pipeload/move/_regions.pyx"], extra_compile_args=["-O3"]),
    Extension("pipeload.save._stage", ["pipeload/save/_stage.pyx"], extra_compile_args=["-O3"]),
]

setup(
    ext_modules=cythonize(
        extensions,
        language_level=3,
        compiler_directives={"boundscheck": False, "wraparound": False, "cdivision": True},
    )
)
