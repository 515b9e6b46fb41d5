"""PromptSource implementations: prompt files (JSONL / Parquet in verl's schema) and the built-in
task; `build_prompt_data` makes the one the config names, with its held-out set."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from pfppo_mega.data.chat import ChatTemplate, ChatTemplateError, template_kwargs
from pfppo_mega.data.files import DataError, FilePrompts, Keys, load_samples
from pfppo_mega.data.sampler import SampledPrompts, SamplerError, load_sampler_class
from pfppo_mega.types import PromptSource, Sample


@dataclass
class PromptData:
    train: PromptSource
    val: list[Sample]              # scored at every evaluation (per data_source)
    train_rows: list[Sample]       # every training row loaded (files; [] for a generated task), for start-up checks
    template: ChatTemplate | None = None  # the chat template the prompts were rendered with (None: none)


def chat_template_of(tokenizer, model_dir: str | Path, kwargs: Sequence[str] = (),
                     tools: list[dict] | None = None) -> ChatTemplate | None:
    """The checkpoint's chat template, with data.chat_template_kwargs (``kwargs``) as its variables and
    ``tools`` (a multi-turn run's tool schemas, as transformers' apply_chat_template(tools=) passes them)."""
    source = tokenizer.chat_template
    extra = template_kwargs(list(kwargs))
    if tools:
        if "tools" in extra:
            raise ChatTemplateError(f"data.chat_template_kwargs = {list(kwargs)} sets 'tools', which a multi-turn run "
                                    f"sets from its tool config (actor_rollout.multi_turn.tool_config_path); remove it")
        extra["tools"] = list(tools)
    if source is None:
        if extra:
            raise ChatTemplateError(f"data.chat_template_kwargs = {list(kwargs)}: the checkpoint ({model_dir}) has no "
                                    f"chat template to pass them to")
        return None
    names = {"bos_token": tokenizer.token(tokenizer.bos_id), "eos_token": tokenizer.token(tokenizer.eos_id),
             "pad_token": tokenizer.token(tokenizer.pad_id)}
    return ChatTemplate(source, special_tokens=names, where=tokenizer.chat_template_file, extra=extra)


def build_prompt_data(cfg, tokenizer, *, model_dir: str | Path, rng: random.Random, dp_rank: int = 0,
                      dp_size: int = 1, log: Callable[[str], None] = print,
                      tools: list[dict] | None = None) -> PromptData:
    """data.source = task: the built-in task drawing from `rng` (the trainer's prompt stream, the same on
    every rank; each replica keeps its slice of the global batch).
    data.source = files: train_files in seeded epochs (training.seed), the first data.eval_size
    rows of val_files held out (none given: the first eval_size training rows, with a note). ``tools``: the
    tool schemas a multi-turn run renders into its prompts (the template's ``tools`` variable)."""
    d = cfg.data
    if d.source == "task":
        from pfppo_mega.tasks.addition import AdditionPrompts, AdditionTask
        src = AdditionPrompts(AdditionTask.from_config(d), tokenizer, rng, dp_rank=dp_rank, dp_size=dp_size)
        return PromptData(train=src, val=src.eval_samples(d.eval_size), train_rows=[])
    template = chat_template_of(tokenizer, model_dir, d.chat_template_kwargs, tools) if d.apply_chat_template else None
    for note in template.notes if template is not None else ():
        log(f"[pfppo] warning: {note}")
    keys = Keys(prompt=d.prompt_key, data_source=d.data_source_key, ground_truth=d.ground_truth_key,
                extra_info=d.extra_info_key)
    common = dict(keys=keys, tokenizer=tokenizer, template=template, max_prompt_length=d.max_prompt_length,
                  overlong=d.overlong_prompts, log=log)
    train = load_samples(d.train_files, key="data.train_files", **common)
    if d.val_files:
        val = load_samples(d.val_files, key="data.val_files", **common)[: d.eval_size]
    else:
        val = train[: d.eval_size]
        log(f"[pfppo] data.val_files not set: evaluating on the first {len(val)} training prompts")
    return PromptData(train=_train_source(cfg, train, dp_rank=dp_rank, dp_size=dp_size, log=log), val=val,
                      train_rows=train, template=template)


def _train_source(cfg, train: list[Sample], *, dp_rank: int, dp_size: int, log) -> PromptSource:
    """The rows in seeded epochs, or in the order of the user's sampler (data.sampler_path)."""
    d = cfg.data
    if not d.sampler_path:
        return FilePrompts(train, seed=cfg.training.seed, shuffle=d.shuffle, dp_rank=dp_rank, dp_size=dp_size)
    cls = load_sampler_class(d.sampler_path, d.sampler_class)
    config = dataclasses.asdict(d) | {"seed": cfg.training.seed}  # a copy: the sampler cannot change ours
    log(f"[pfppo] prompts drawn by {d.sampler_class} ({d.sampler_path}) over {len(train)} rows")
    return SampledPrompts(train, cls, config=config, seed=cfg.training.seed, dp_rank=dp_rank, dp_size=dp_size,
                          log=log)


__all__ = ["DataError", "FilePrompts", "SampledPrompts", "SamplerError", "PromptData", "build_prompt_data", "chat_template_of"]
