"""Generation engines behind one interface (RolloutEngine)."""

from pfppo_mega.families import DecoderShape
from pfppo_mega.rollout.base import RolloutEngine, RolloutOutput, SamplingParams
from pfppo_mega.rollout.builtin import BuiltinEngine
from pfppo_mega.rollout.llama import LlamaDecoder

__all__ = [
    "BuiltinEngine",
    "DecoderShape",
    "LlamaDecoder",
    "RolloutEngine",
    "RolloutOutput",
    "SamplingParams",
]
