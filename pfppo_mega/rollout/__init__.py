"""Generation engines behind one interface (RolloutEngine)."""

from pfppo_mega.rollout.base import RolloutEngine, RolloutOutput, SamplingParams
from pfppo_mega.rollout.builtin import BuiltinEngine
from pfppo_mega.rollout.llama import LlamaDecoder, LlamaShape

__all__ = [
    "BuiltinEngine",
    "LlamaDecoder",
    "LlamaShape",
    "RolloutEngine",
    "RolloutOutput",
    "SamplingParams",
]
