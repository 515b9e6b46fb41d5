"""Named implementations a config key chooses between, each registered once.

A ``Registry`` is what the config tree validates a choice against (it behaves as the tuple of
its names) and what the run builder asks for the implementation. The project's own entries are
declared here, one line each, as ``"module:attribute"`` and imported on first use, so this module
imports nothing of the project and the config tree can read the names without loading vLLM or a
trainer. Code outside the package (a test, a user's plug-in) registers an object directly:

    ROLLOUT_ENGINES.register("my_engine", MyEngineSpec())

Adding an engine or an advantage estimator to the project is its module plus one line below.
"""

from __future__ import annotations

import importlib
from typing import Any, Iterator


class Registry:
    """name -> implementation for the config key ``key``; a second registration of a name is refused."""

    def __init__(self, key: str, declared: dict[str, str]) -> None:
        self.key = key
        self._declared = dict(declared)   # name -> "module:attribute", imported on first get()
        self._loaded: dict[str, Any] = {}

    def register(self, name: str, obj: Any) -> Any:
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.key}: a registered name must be a non-empty string, got {name!r}")
        if name in self:
            raise ValueError(f"{self.key}: {name!r} is already registered")
        self._loaded[name] = obj
        return obj

    def unregister(self, name: str) -> None:
        """Drop an entry registered at run time (a test's); the project's declared ones stay."""
        if name in self._declared:
            raise ValueError(f"{self.key}: {name!r} is one of the project's own entries")
        self._loaded.pop(name, None)

    def get(self, name: str) -> Any:
        if name not in self:
            raise ValueError(f"{self.key} = {name!r}: must be one of {', '.join(map(repr, self))}")
        if name not in self._loaded:
            module, attr = self._declared[name].split(":")
            self._loaded[name] = getattr(importlib.import_module(module), attr)
        return self._loaded[name]

    # the config tree treats a registry as the tuple of its names (CHOICES, the reference)
    def __contains__(self, name: object) -> bool:
        return name in self._declared or name in self._loaded

    def __iter__(self) -> Iterator[str]:
        yield from self._declared
        yield from (n for n in self._loaded if n not in self._declared)

    def __len__(self) -> int:
        return len(tuple(iter(self)))

    def __repr__(self) -> str:
        return f"Registry({self.key!r}, {tuple(self)!r})"


# actor_rollout.engine -> an EngineSpec (pfppo_mega.rollout.base): its checks and its constructor
ROLLOUT_ENGINES = Registry("actor_rollout.engine", {
    "builtin": "pfppo_mega.rollout.builtin:ENGINE",
    "vllm": "pfppo_mega.rollout.vllm:ENGINE",
})

# algorithm.adv_estimator -> an AdvantageEstimator (pfppo_mega.trainer.estimators)
ADV_ESTIMATORS = Registry("algorithm.adv_estimator", {
    "gae": "pfppo_mega.trainer.estimators:GAE",
    "grpo": "pfppo_mega.trainer.estimators:GRPO",
    "grpo_passk": "pfppo_mega.trainer.estimators:GRPO_PASSK",
    "rloo": "pfppo_mega.trainer.estimators:RLOO",
    "opo": "pfppo_mega.trainer.estimators:OPO",
    "gpg": "pfppo_mega.trainer.estimators:GPG",
    "reinforce_plus_plus": "pfppo_mega.trainer.estimators:REINFORCE_PLUS_PLUS",
    "reinforce_plus_plus_baseline": "pfppo_mega.trainer.estimators:REINFORCE_PLUS_PLUS_BASELINE",
    "remax": "pfppo_mega.trainer.estimators:REMAX",
    "optimal_token_baseline": "pfppo_mega.trainer.estimators:OPTIMAL_TOKEN_BASELINE",
})
