"""Colocation: the trainer and the rollout engine on one set of devices. Generation (the phase order
of a rollout), engine sync (refit and snapshot switches), offload of the trainer's states, and the
split of the rollout over the engines."""
