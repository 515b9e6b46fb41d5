"""Rows for verl's data section (shared with our tree: a key listed here is verl's, else ours): files,
lengths, batch sizes and what happens to a prompt over max_prompt_length.
"""

from __future__ import annotations

import json
from typing import Any, Callable
from typing import Optional

from pfppo_mega.config.verl.reasons import COPY_TOKENIZER, MULTIMODAL, SPEED
from pfppo_mega.config.verl.rule import Bad, I, Ignore, M, Out, R, Refuse, Rule, View, _typed


def _overlong(value: Any, v: View) -> Any:
    if _typed(value, bool):
        return Out({"data.overlong_prompts": "filter"}, "prompts over data.max_prompt_length are dropped at start")
    raise Ignore("read with data.truncation (see that key)")


def _truncation(value: Any, v: View) -> Any:
    mode = _typed(value, str)
    if mode not in ("error", "left", "right", "middle"):
        raise Bad(f"must be one of 'error', 'left', 'right', 'middle' (verl's data.truncation), got {mode!r}")
    if v.typed("data.filter_overlong_prompts", bool):
        raise Ignore("prompts over max_prompt_length are dropped first (filter_overlong_prompts)")
    if mode == "error":
        return Out({"data.overlong_prompts": "error"}, "a prompt over data.max_prompt_length is refused")
    return Out({"data.overlong_prompts": mode}, f"a prompt over data.max_prompt_length is cut to it at the {mode}, "
                                                "after the chat template (verl's postprocess_data)")


def _files(target: str) -> Callable[[Any, View], Any]:
    def convert(value: Any, v: View) -> Any:
        files = _typed(value, list[str])
        out = {target: files}
        if target == "data.train_files":
            out["data.source"] = "files"
        note = "our held-out evaluation scores the first data.eval_size rows (verl: all)" \
            if target == "data.val_files" else ""
        return Out(out, note)
    return convert


def _gen_batch(value: Any, v: View) -> Any:
    if value is None or value == v.get("data.train_batch_size"):
        raise Ignore("equal to data.train_batch_size")
    gen, train = _typed(value, int), v.typed("data.train_batch_size", int)
    if v.typed("algorithm.filter_groups.enable", Optional[bool]) is not True:
        raise Refuse(f"{gen} prompts generated per step, {train} trained on, without algorithm.filter_groups."
                     f"enable: verl's DAPO trainer then trains on all {gen}; set data.train_batch_size={gen} for "
                     f"that, or algorithm.filter_groups.enable=True for dynamic sampling")
    if gen < train:
        raise Refuse(f"fewer prompts generated per round ({gen}) than trained on (data.train_batch_size = {train}): "
                     "verl's DAPO trainer needs several rounds even when no group is dropped; set gen_batch_size >= "
                     "train_batch_size")
    return gen


def _sampler(value: Any, v: View) -> Any:
    path = _typed(value, Optional[str])
    if not path:
        raise Ignore("no sampler: the rows in seeded epochs")
    name = v.typed("data.sampler.class_name", Optional[str])
    if not name:
        raise Bad("needs data.sampler.class_name, the class in that module or file")
    return Out({"data.sampler_path": path, "data.sampler_class": name},
               f"{name} from {path} draws the rows (built as verl builds it); a curriculum's update(batch) gets a "
               "dict of the step's rows and scores (index, score, reward, data_source, row, step), not a DataProto")


KWARGS = "data.apply_chat_template_kwargs"


def _template_kwargs(value: Any, v: View) -> Out:
    """Every data.apply_chat_template_kwargs.NAME of the config as NAME=<JSON value> (the same list from
    each of them), what verl's dataset passes to apply_chat_template(**kwargs)."""
    items = sorted((k[len(KWARGS) + 1:], val) for k, val in v.given.items() if k.startswith(KWARGS + "."))
    if not items and value not in ({}, None):
        raise Bad("must be a mapping of the template's variable names to values")
    for name, val in items:
        if not name.isidentifier() or not _json_ok(val):
            raise Bad(f"{KWARGS}.{name}: the name must be an identifier and the value JSON")
    return Out({"data.chat_template_kwargs": [f"{name}={json.dumps(val)}" for name, val in items]})


def _json_ok(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _same_tools(value: Any, v: View) -> Any:
    """data.tool_config_path: the rollout's tools, or none (verl reads both files; one file here)."""
    rollout = v.get("actor_rollout_ref.rollout.multi_turn.tool_config_path")
    if value is not None and rollout is not None and value != rollout:
        raise Bad(f"differs from actor_rollout_ref.rollout.multi_turn.tool_config_path ({rollout!r}): here the prompts "
                  f"are rendered with the rollout's tools; set both to one file")
    return value


RULES: tuple[Rule, ...] = (
    # ---------------------------------------------------------------- data
    M("data.train_files", "data.train_files, data.source", _files("data.train_files"), why='data.source = files'),
    M("data.val_files", "data.val_files", _files("data.val_files"), why='our evaluation scores the first data.eval_size rows'),
    M("data.prompt_key", "data.prompt_key"),
    M("data.reward_fn_key", "data.data_source_key"),
    M("data.max_prompt_length", "data.max_prompt_length"),
    M("data.max_response_length", "algorithm.max_response_length"),
    M("data.train_batch_size", "training.rollout_batch_size",
      why="prompts per step in both trees"),
    M("data.gen_batch_size", "algorithm.filter_groups.gen_batch_size", _gen_batch,
      why="prompts per round of DAPO's dynamic sampling (needs algorithm.filter_groups.enable; >= train_batch_size)"),
    M("data.shuffle", "data.shuffle"),
    M("data.filter_overlong_prompts", "data.overlong_prompts", _overlong, why='true: filter'),
    M("data.truncation", "data.overlong_prompts", _truncation,
      why="error / left / right / middle (without filtering): the same name; prompts cut as verl does"),
    R("data.tokenizer", "a tokenizer apart from the checkpoint's", ok=(None,), fix=COPY_TOKENIZER),
    R("data.train_max_samples", "training on a subset of the rows", ok=(-1, None)),
    I("data.val_max_samples", "validation only: here the first data.eval_size rows are scored"),
    I("data.val_batch_size", "validation batching; " + SPEED),
    I("data.seed", "every random draw here is seeded by training.seed"),
    I("data.use_shm", SPEED), I("data.dataloader_num_workers", SPEED), I("data.filter_overlong_prompts_workers", SPEED),
    I("data.return_raw_input_ids", "how verl passes prompts to its workers"),
    I("data.return_raw_chat", "how verl passes prompts to its workers (here rendered with the chat template)"),
    I("data.return_full_prompt", "how verl passes prompts to its workers"),
    I("data.trust_remote_code", "no checkpoint code is run here"),
    I("data.validation_shuffle", "validation order"),
    *(I(f"data.{k}", MULTIMODAL) for k in ("image_key", "video_key", "image_patch_size",
                                           "return_multi_modal_inputs")),
    I("data.tool_config_path", "verl's dataset renders the prompts with these tools' schemas (for its length "
      "filter); here the prompts are rendered with the tools of actor_rollout_ref.rollout.multi_turn."
      "tool_config_path", check=_same_tools),
    R("data.custom_cls.path", "a user's dataset class", ok=(None,),
      fix="write the rows as parquet or jsonl in verl's columns (prompt, data_source, reward_model.ground_truth) "
          "and remove data.custom_cls"), I("data.custom_cls.name", "custom_cls.path only"),
    M("data.sampler.class_path", "data.sampler_path, data.sampler_class", _sampler,
      why="the user's sampler draws the rows; a curriculum's update(batch) gets a dict of the step's rows and "
          "scores, not verl's DataProto"),
    I("data.sampler.class_name", "read with data.sampler.class_path"),
    R("data.datagen.path", "a user's data generator", ok=(None,)), I("data.datagen.name", "datagen.path only"),
    M("data.apply_chat_template_kwargs", "data.chat_template_kwargs", _template_kwargs,
      why="each name and value as name=<JSON value>"),
    M("data.apply_chat_template_kwargs.**", "data.chat_template_kwargs", _template_kwargs,
      why="each name and value as name=<JSON value>, passed to the chat template"),
)
