"""Build script: setuptools + cffi (API mode). Metadata lives in pyproject.toml.

The only custom step: the native sources are C++17 while cffi's generated
wrapper is C, so ``build_ext`` adds ``-std=c++17`` to .cpp files only.
"""

from setuptools import setup
from setuptools.command.build_ext import build_ext


class _BuildExt(build_ext):
    def build_extensions(self):
        compiler = self.compiler
        original = compiler._compile

        def _compile(obj, src, ext, cc_args, extra_postargs, pp_opts):
            if src.endswith(".cpp"):
                extra_postargs = list(extra_postargs) + ["-std=c++17"]
            return original(obj, src, ext, cc_args, extra_postargs, pp_opts)

        compiler._compile = _compile
        super().build_extensions()


setup(
    cffi_modules=["torch_pccl/_build_native.py:ffibuilder"],
    cmdclass={"build_ext": _BuildExt},
)
