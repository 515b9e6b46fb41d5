"""Compatibility layers for dependencies; today only megatron-core on a CPU build of torch."""

from pfppo_mega.compat.megatron_cpu import PINNED_MEGATRON_CORE, enable, model_parallel_manual_seed

__all__ = ["PINNED_MEGATRON_CORE", "enable", "model_parallel_manual_seed"]
