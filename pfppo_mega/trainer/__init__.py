"""The PPO / PF-PPO training loop, its typed batches, metrics and checkpoints."""
