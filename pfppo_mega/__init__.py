"""pfppo_mega: a Megatron-core based PPO / PF-PPO training backend for LLM RL fine-tuning."""

__version__ = "0.1.0"
