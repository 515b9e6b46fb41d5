"""Native extension pfppo_mega._C for setup.py, and an in-place build for development.

setup.py:   from build_ext import extensions, cmdclass
            setup(..., ext_modules=extensions(), cmdclass=cmdclass())
by hand:    python build_ext.py          (builds pfppo_mega/_C*.so in place)

The CPU kernels (csrc/cpu, OpenMP) are always built. The CUDA kernels (csrc/cuda) are added
when torch is a CUDA build and nvcc is found (CUDA_HOME); PFPPO_BUILD_CUDA=0 or 1 overrides.
TORCH_CUDA_ARCH_LIST picks the GPU architectures (default "9.0", i.e. sm_90).
"""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
CSRC = "csrc"

def _sources(folder: str, pattern: str) -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / CSRC / folder).glob(pattern))


# The host side (the module, every op's host wrapper: csrc/<op>.h compiled once by ops.cpp,
# the shared checks) and every kernel of a device folder: a new op's kernels need no line here.
# csrc/cpu also holds the decoder-layer kernels (pfppo_mega.models.fused_layers) and the refit
# byte fingerprint (pfppo_mega.rollout.weights).
CPU_SOURCES = [f"{CSRC}/module.cpp", f"{CSRC}/ops.cpp", f"{CSRC}/api.cpp"] + _sources("cpu", "*.cpp")
CUDA_SOURCES = _sources("cuda", "*.cu")
# No -ffast-math: NaN/inf keep their meaning. -fno-trapping-math and -fno-math-errno only let
# GCC vectorise selects and libm calls. -Werror=switch: a row of an op's mode table without its
# case in the op's shared switches (csrc/<op>.h) fails the build.
CXX_FLAGS = ["-O3", "-fopenmp", "-fno-trapping-math", "-fno-math-errno", "-Werror=switch"]
NVCC_FLAGS = ["-O3", "-Xcompiler=-Werror=switch"]


def build_cuda() -> bool:
    """True when the CUDA kernels should be compiled into pfppo_mega._C."""
    forced = os.environ.get("PFPPO_BUILD_CUDA")
    if forced is not None:
        return forced == "1"
    import torch
    from torch.utils.cpp_extension import CUDA_HOME

    return torch.version.cuda is not None and CUDA_HOME is not None


def extensions() -> list:
    """The setuptools extensions to build (one: pfppo_mega._C)."""
    from torch.utils.cpp_extension import CppExtension, CUDAExtension

    common = dict(
        include_dirs=[str(ROOT / CSRC)],
        extra_link_args=["-fopenmp"],
    )
    if build_cuda():
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
        return [
            CUDAExtension(
                "pfppo_mega._C",
                CPU_SOURCES + CUDA_SOURCES,
                define_macros=[("PFPPO_WITH_CUDA", "1")],
                extra_compile_args={"cxx": CXX_FLAGS, "nvcc": NVCC_FLAGS},
                **common,
            )
        ]
    return [
        CppExtension(
            "pfppo_mega._C", CPU_SOURCES, extra_compile_args={"cxx": CXX_FLAGS}, **common
        )
    ]


def cmdclass() -> dict:
    """{"build_ext": torch's BuildExtension} (ninja builds, torch flags and ABI)."""
    from torch.utils.cpp_extension import BuildExtension

    return {"build_ext": BuildExtension}


def main() -> int:
    from setuptools import setup

    os.chdir(ROOT)
    setup(
        name="pfppo_mega_kernels",
        ext_modules=extensions(),
        cmdclass=cmdclass(),
        script_args=["build_ext", "--inplace"] + sys.argv[1:],
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
