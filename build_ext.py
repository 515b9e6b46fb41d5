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

CPU_SOURCES = [
    f"{CSRC}/module.cpp",
    f"{CSRC}/ops.cpp",
    f"{CSRC}/api.cpp",
    f"{CSRC}/policy_loss.cpp",  # the policy loss's host wrapper (both devices)
    f"{CSRC}/cpu/logprob_entropy.cpp",
    f"{CSRC}/cpu/policy_loss.cpp",
    f"{CSRC}/cpu/gae.cpp",
    f"{CSRC}/cpu/layers.cpp",  # fused RMSNorm / SwiGLU / RoPE (pfppo_mega.models.fused_layers)
    f"{CSRC}/cpu/fingerprint.cpp",  # refit byte fingerprint (pfppo_mega.rollout.weights)
]
CUDA_SOURCES = [
    f"{CSRC}/cuda/logprob_entropy.cu",
    f"{CSRC}/cuda/policy_loss.cu",
    f"{CSRC}/cuda/gae.cu",
]
# No -ffast-math: NaN/inf keep their meaning. These two only let GCC vectorise selects and
# libm calls.
CXX_FLAGS = ["-O3", "-fopenmp", "-fno-trapping-math", "-fno-math-errno"]
NVCC_FLAGS = ["-O3"]


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
