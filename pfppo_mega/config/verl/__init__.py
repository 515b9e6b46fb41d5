"""verl's config layout, read as this trainer's tree: one translation table, RULES.

A config (YAML or `key=value` overrides, hydra's `+key` / `++key` / `~key` forms included) that
has one of verl's own top-level sections (``VERL_HEADS``: actor_rollout_ref, critic, trainer,
reward_model, custom_reward_function, ...) is read in verl's layout. Every verl key then goes
through the first rule of RULES that matches it (exact keys first, then patterns: ``*`` is one
key segment, ``**`` any tail; a closed subtree names verl's keys under it, so a typo there is an
unknown key) and is

    mapped    onto one or more of our keys, its value converted (verl's units and semantics:
              ppo_mini_batch_size counts prompts, use_pf_ppo is policy filtration, ...);
    ignored   accepted with a printed reason (Ray placement, FSDP-only, speed or memory only,
              logger names, settings of a feature that is off);
    refused   by name with the reason, where accepting it would change the result.

Keys of the shared sections (``algorithm.*``, ``data.*``) are verl's when the table knows them,
else ours; a verl key and one of ours that set the same key of ours is an error naming both.
verl's defaults that change the result and differ from ours (``VERL_DEFAULTS``: KL off, lam 1.0,
weight decay 0.01, ...) are applied to the keys a verl config leaves out, as verl would; one of
our own keys given explicitly wins over them. ``${key}`` / ``${oc.select:key,default}``
interpolations between verl keys are resolved first.

The loader (``pfppo_mega.config.loader``) calls :func:`translate`; ``pfppo validate`` prints
each record. docs/verl.md is generated from RULES (``pfppo_mega.config.verl_doc``).

The package, file by file (each reads on its own):

    keys.py           verl's sections (VERL_HEADS), the actor_rollout_ref prefixes, VERL_DEFAULTS, VERL_FIXED
    rule.py           the row type (Rule; M / I / R), the converters' vocabulary (View, Out, Ignore,
                      Refuse, Bad) and a refusal's wording
    reasons.py        reasons and fixes many rows share
    convert.py        converters several sections share; kl.py and optim.py: KL and the lr schedule
    actor.py, rollout.py, algorithm.py, data.py, critic.py, reward.py, trainer.py
                      the rows of each verl section, with the converters only they use
    table.py          RULES in match order, rule_for, suggest
    layout.py         is a config in verl's layout, is a key verl's (hydra's +/++/~ prefixes)
    interpolation.py  ${...} between verl keys
    translate.py      translate: the rows applied, the records (VerlUse) and the Translation
"""

from __future__ import annotations

from pfppo_mega.config.verl.convert import _float
from pfppo_mega.config.verl.keys import (A, LORA_KEYS, M_, NATIVE_EQUIVALENTS, R_, SHARED_HEADS, VERL_DEFAULTS,
                                         VERL_FIXED, VERL_HEADS)
from pfppo_mega.config.verl.kl import KL_NAMES
from pfppo_mega.config.verl.layout import is_verl_key, is_verl_layout, native_knows, strip_hydra
from pfppo_mega.config.verl.interpolation import resolve_interpolations
from pfppo_mega.config.verl.optim import OPTIM_DEFAULTS, SCHEDULES
from pfppo_mega.config.verl.reasons import (COPY_TOKENIZER, CRITIC_LAYOUT, DYNAMIC_BSZ, FORWARD_MICRO, FSDP, HYDRA,
                                            LOGS, MERGE_ADAPTER, MOE, MULTIMODAL, NO_CORRECTION, PROFILE, RAY,
                                            REF_LAYOUT, SINGLE_TURN, SPEED)
from pfppo_mega.config.verl.reward import OVERLONG, OVERLONG_RECIPE
from pfppo_mega.config.verl.rule import I, M, R, Bad, Ignore, Out, Refuse, Rule, View, refusal
from pfppo_mega.config.verl.table import RULES, rule_for, suggest
from pfppo_mega.config.verl.translate import Translation, VerlUse, translate

__all__ = [
    "A", "Bad", "COPY_TOKENIZER", "CRITIC_LAYOUT", "DYNAMIC_BSZ", "FORWARD_MICRO", "FSDP", "HYDRA", "I", "Ignore",
    "KL_NAMES", "LOGS", "LORA_KEYS", "M", "MERGE_ADAPTER", "MOE", "MULTIMODAL", "M_", "NATIVE_EQUIVALENTS",
    "NO_CORRECTION", "OPTIM_DEFAULTS", "OVERLONG", "OVERLONG_RECIPE", "Out", "PROFILE", "R", "RAY", "REF_LAYOUT",
    "RULES", "R_", "Refuse", "Rule", "SCHEDULES", "SHARED_HEADS", "SINGLE_TURN", "SPEED", "Translation",
    "VERL_DEFAULTS", "VERL_FIXED", "VERL_HEADS", "VerlUse", "View", "_float", "is_verl_key", "is_verl_layout",
    "native_knows", "refusal", "resolve_interpolations", "rule_for", "strip_hydra", "suggest", "translate",
]
