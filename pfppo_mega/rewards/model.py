"""A reward model: a Hugging Face one-label sequence-classification checkpoint scoring each
prompt + response at its last token, and the weighted sum of it with a rule-based scorer.

The checkpoint (``reward.model_path``) is a Llama / Qwen2 / Qwen3 / Mistral
``*ForSequenceClassification`` with ``num_labels`` 1: the decoder trunk (no LM head) and
``score.weight`` [1, H] without bias. It is loaded into the critic's model (megatron GPTModel whose
output layer is a scalar head, ``gpt.build_critic``) on the actor's ranks, with the actor's
tensor x pipeline layout, and run through ``passes.forward_values``: every rank of a model replica
passes the same rows and gets the same scores back (the last pipeline stage's scores are
broadcast to the others; the head is replicated over tensor-parallel ranks); each data-parallel
rank scores its own rows.

The rows are the policy's token ids: the prompt's ids as the engine saw them, then the response
text encoded with the policy's tokenizer (the RewardFn protocol hands over texts; decoding and
re-encoding gives the canonical tokenization of the same text, which is what a reward model is
trained on), then EOS when the response finished. The score of a row is the head's output at its
last real token: rows are right-padded and the padding is never read, as transformers reads
``logits[i, last non-pad token]`` (with a pad_token_id distinct from the row's tokens).

Refused at start, with the path, the key and the value: a vocabulary other than the policy's
(vocab_size, or tokenizer.json's token -> id map: the scorer reads the policy's token ids as they
are), a checkpoint that is not a one-label sequence classifier (a CausalLM, num_labels != 1, a
score bias, no score.weight), a context shorter than prompt + response.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from pfppo_mega.families import ARCHITECTURES, ModelDirError, model_type_of
from pfppo_mega.rewards.base import OutcomeLog, RewardSetupError
from pfppo_mega.types import PackedInputs, RewardFn, RewardResult, Sample

SCORE_HEAD = "score.weight"
CLASSIFIERS = {family: arch.replace("ForCausalLM", "ForSequenceClassification")
               for family, arch in ARCHITECTURES.items()}


# ----------------------------------------------------------------------------- checks at start


def _num_labels(hf: dict, where: str) -> int:
    """num_labels as transformers reads config.json: ``num_labels``, else len(id2label); a config
    with neither is read as 2 labels by transformers, so it is refused too."""
    if "num_labels" in hf:
        n = hf["num_labels"]
    elif isinstance(hf.get("id2label"), dict):
        n = len(hf["id2label"])
    else:
        raise RewardSetupError(f"{where}: config.json has neither num_labels nor id2label (transformers reads "
                               f"that as 2 labels); a reward model needs num_labels = 1")
    return n


def config_file(path: str | Path) -> str:
    """How messages name the reward model's config.json (issue 24.8: the key alone left the user
    guessing which of the two checkpoints' files it was)."""
    return f"the reward model's config file {str(Path(path) / 'config.json')!r}"


def _positive_ints(hf: dict, path: str | Path, keys: tuple[str, ...] = ("hidden_size", "vocab_size")) -> None:
    where = f"reward.model_path {str(path)!r}"
    for key in keys:
        if key not in hf:
            raise RewardSetupError(f"{where}: {config_file(path)} has no {key} (a positive integer is needed)")
        v = hf[key]
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise RewardSetupError(f"{where}: {config_file(path)} has {key} = {v!r}; must be a positive integer")


def check_classifier(path: str | Path) -> dict:
    """config.json of a one-label ``*ForSequenceClassification`` checkpoint at ``path``, or
    RewardSetupError naming the file, key or tensor and its value."""
    from pfppo_mega.models import hf_io

    where = f"reward.model_path {str(path)!r}"
    try:
        hf = hf_io.read_hf_config(path)
        reader = hf_io.CheckpointReader(path)
    except ModelDirError as e:  # missing directory / config.json / safetensors, unreadable JSON
        raise RewardSetupError(f"{where}: {e}") from None
    archs = hf.get("architectures")
    family = model_type_of(hf)
    if isinstance(archs, list) and archs:
        bad = [a for a in archs if a not in CLASSIFIERS.values()]
        if bad:
            want = CLASSIFIERS.get(family, "a *ForSequenceClassification")
            kind = " (a language model, not a reward model)" if any(str(a).endswith("ForCausalLM") for a in bad) else ""
            raise RewardSetupError(f"{where}: config.json architectures = {archs!r}{kind}; a reward model is "
                                   f"a sequence-classification checkpoint ({want}, num_labels 1); supported: "
                                   f"{', '.join(CLASSIFIERS.values())}")
    _positive_ints(hf, path)
    n = _num_labels(hf, where)
    if n != 1:
        key = "num_labels" if "num_labels" in hf else "id2label"
        raise RewardSetupError(f"{where}: config.json {key} = {hf.get(key)!r} ({n} labels); a reward model "
                               f"scores with one label (num_labels = 1, score.weight [1, hidden_size])")
    names = set(reader.names())
    if "score.bias" in names:
        raise RewardSetupError(f"{where}: tensor score.bias {reader.shape('score.bias')} is present; "
                               f"transformers' *ForSequenceClassification score head has no bias (it would be "
                               f"silently dropped)")
    if SCORE_HEAD not in names:
        causal = " (it holds lm_head.weight: a CausalLM, not a reward model)" if "lm_head.weight" in names else ""
        raise RewardSetupError(f"{where}: tensor {SCORE_HEAD} is missing{causal}; a reward model is a "
                               f"*ForSequenceClassification checkpoint with {SCORE_HEAD} [1, hidden_size]")
    shape = reader.shape(SCORE_HEAD)
    hidden = hf.get("hidden_size")
    if shape != (1, hidden):
        raise RewardSetupError(f"{where}: tensor {SCORE_HEAD} has shape {shape}; {config_file(path)} has "
                               f"hidden_size = {hidden!r}, so (1, {hidden}) was expected (one label)")
    return hf


def _vocab(directory: Path, where: str) -> dict[str, int]:
    from pfppo_mega.tokenizer import Tokenizer, TokenizerError

    try:
        return Tokenizer.from_dir(directory).hf.get_vocab(with_added_tokens=True)
    except TokenizerError as e:
        raise RewardSetupError(f"{where}: {e} (the reward model must ship the policy's tokenizer files: it reads "
                               f"the policy's token ids)") from None


def check_same_vocabulary(rm_path: str | Path, rm_hf: dict, policy_path: str | Path, policy_hf: dict) -> None:
    """Refuse a reward model whose vocabulary differs from the policy's: config.json vocab_size,
    then tokenizer.json's token -> id map (both named, with the first difference)."""
    rm, pol = f"reward.model_path {str(rm_path)!r}", f"actor_rollout.model_path {str(policy_path)!r}"
    if rm_hf.get("vocab_size") != policy_hf.get("vocab_size"):
        raise RewardSetupError(f"the reward model's vocabulary differs from the policy's: {rm}: {config_file(rm_path)} "
                               f"has vocab_size = {rm_hf.get('vocab_size')!r}, {pol}: the policy's config file "
                               f"{str(Path(policy_path) / 'config.json')!r} has vocab_size = "
                               f"{policy_hf.get('vocab_size')!r}; the reward model reads the policy's token ids, so "
                               f"both need the same tokenizer")
    a, b = _vocab(Path(rm_path), rm), _vocab(Path(policy_path), pol)
    if a != b:
        diff = sorted(set(a.items()) ^ set(b.items()), key=lambda kv: kv[1])[0]
        token = diff[0]
        raise RewardSetupError(f"the reward model's tokenizer differs from the policy's: reward.model_path's "
                               f"{str(Path(rm_path) / 'tokenizer.json')!r} has {len(a)} tokens, actor_rollout."
                               f"model_path's {str(Path(policy_path) / 'tokenizer.json')!r} {len(b)}; first "
                               f"difference: token {token!r} is id {a.get(token)!r} in the reward model and "
                               f"{b.get(token)!r} in the policy")


# ----------------------------------------------------------------------------- the scorer


def last_token_inputs(sequences: Sequence[Sequence[int]], *, pad_id: int = 0) -> PackedInputs:
    """Right-padded rows [B, S] with one 'response position' per row: its last real token."""
    if not sequences or any(len(s) == 0 for s in sequences):
        raise ValueError("every row to score needs at least one token")
    b, s = len(sequences), max(len(x) for x in sequences)
    ids = torch.full((b, s), pad_id, dtype=torch.long)
    mask = torch.zeros(b, s, dtype=torch.bool)
    for i, x in enumerate(sequences):
        ids[i, : len(x)] = torch.tensor(list(x), dtype=torch.long)
        mask[i, : len(x)] = True
    last = mask.sum(1, keepdim=True) - 1                                           # [B, 1]
    return PackedInputs(ids, mask, last, torch.zeros(b, 1, dtype=torch.long), torch.ones(b, 1))


class RewardModel:
    """RewardFn: the sequence classifier's score of prompt + response at its last token.

    Collective: every rank of the trainer calls it at the same time (the rows of one model
    replica identical on its tensor- and pipeline-parallel ranks). Build after
    ``parallel.init_parallel``; the layout is the one initialised (the actor's). ``encode`` and
    ``eos_id``: the policy tokenizer's, for ``__call__`` (``score_ids`` takes token ids)."""

    def __init__(self, path: str | Path, *, encode: Optional[Callable[[str], list[int]]] = None,
                 eos_id: Optional[int] = None, params_dtype: str = "float32", micro_batch_size: Optional[int] = None,
                 max_length: Optional[int] = None, log: Callable[[str], None] = print):
        from pfppo_mega.config.tree import ModelConfig
        from pfppo_mega.models import gpt, hf_io

        self.path = str(path)
        hf = check_classifier(path)
        where = f"reward.model_path {self.path!r}"
        try:
            model_cfg = hf_io.model_config_from_hf(hf, ModelConfig(params_dtype=params_dtype))
            arch = hf_io.architecture_from_hf(hf)
        except ModelDirError as e:
            raise RewardSetupError(f"{where}: {e}") from None
        if max_length is not None and max_length > model_cfg.max_position_embeddings:
            raise RewardSetupError(f"{where}: max_position_embeddings = {model_cfg.max_position_embeddings} < "
                                   f"data.max_prompt_length + algorithm.max_response_length = {max_length}")
        self.model_cfg = dataclasses.replace(model_cfg, tie_word_embeddings=False)
        self.micro_batch_size, self.eos_id, self.encode = micro_batch_size, eos_id, encode
        self.outcomes = OutcomeLog(log, f"reward model {self.path}")
        try:
            critic = gpt.build_critic(self.model_cfg, arch=arch)
        except ValueError as e:  # the layout cannot split it (heads, groups, ffn, layers)
            raise RewardSetupError(f"{where}: {e}") from None
        try:
            hf_io.load_score_model_from_hf(critic, path)
        except ModelDirError as e:  # tensors of another shape than config.json says
            raise RewardSetupError(f"{where}: {e}; {config_file(path)} has vocab_size = {hf['vocab_size']}, "
                                   f"hidden_size = {hf['hidden_size']}: the tensors must have those shapes") from None
        self.model = gpt.wrap_frozen(critic)  # bf16: megatron's wrapper casts the norms, inputs and output
        log(f"[pfppo] reward model: {self.path} ({arch.family}, {model_cfg.num_layers} layers, hidden "
            f"{model_cfg.hidden_size}), scoring the last token of prompt + response")

    def score_ids(self, sequences: Sequence[Sequence[int]]) -> torch.Tensor:
        """Scores [B] float32 of token-id rows (collective, see the class docstring)."""
        from pfppo_mega.models import passes

        inputs = last_token_inputs(sequences)
        mbs = self.micro_batch_size or len(sequences)
        return passes.forward_values(self.model, inputs, micro_batch_size=mbs)[:, 0]

    def sequences(self, samples: Sequence[Sample], texts: Sequence[str], finished: Sequence[bool]) -> list[list[int]]:
        """prompt ids + encode(response text) (+ EOS when finished), per row."""
        if self.encode is None:
            raise ValueError("RewardModel needs encode= (the policy tokenizer's) to score response texts")
        eos = [] if self.eos_id is None else [self.eos_id]
        return [list(s.prompt_ids) + self.encode(t) + (eos if f else []) for s, t, f in zip(samples, texts, finished)]

    def __call__(self, samples: Sequence[Sample], texts: Sequence[str], finished: Sequence[bool]) -> RewardResult:
        scores = self.score_ids(self.sequences(samples, texts, finished))
        outcomes = []
        for i, v in enumerate(scores.tolist()):
            if math.isfinite(v):
                outcomes.append("ok")
            else:
                self.outcomes.once("bad_rewards", f"scored {v}", samples[i], texts[i])
                outcomes.append("bad_rewards")
        scores = torch.where(torch.isfinite(scores), scores, torch.zeros_like(scores))
        return RewardResult(scores.float().cpu(), outcomes)

    def check(self, samples: Sequence[Sample], where: str) -> None:  # scores any row
        pass

    def close(self) -> None:
        pass


class WeightedReward:
    """rule_weight * (rule-based / custom / task score) + model_weight * (reward model score).
    A row's outcome is its first non-ok part's (a bad part scores 0 in the sum and is counted).

    The honest metric is not weighted: when a part carries one (the rule scorer wrapped in
    reward.shaping, rewards/shaping.py), the result carries that part's `honest` unchanged (the
    first such part's) and `hacked` is true where any part marks it, so reward/honest,
    reward/hacked_frac and eval/honest_accuracy are still logged with a reward model."""

    def __init__(self, parts: Sequence[tuple[float, RewardFn]]):
        self.parts = [(float(w), fn) for w, fn in parts]

    def __call__(self, samples: Sequence[Sample], texts: Sequence[str], finished: Sequence[bool]) -> RewardResult:
        total = torch.zeros(len(samples), dtype=torch.float64)
        outcomes = ["ok"] * len(samples)
        honest: Optional[torch.Tensor] = None
        hacked: Optional[torch.Tensor] = None
        for weight, fn in self.parts:
            res = fn(samples, texts, finished)
            total += weight * res.scores.double()
            outcomes = [o if o != "ok" else p for o, p in zip(outcomes, res.outcomes)]
            if res.honest is not None and honest is None:
                honest = res.honest.float()
            if res.hacked is not None:
                hacked = res.hacked.bool() if hacked is None else hacked | res.hacked.bool()
        return RewardResult(total.float(), outcomes, honest=honest, hacked=hacked)

    def check(self, samples: Sequence[Sample], where: str) -> None:
        for _, fn in self.parts:
            try:
                fn.check(samples, where)
            except RewardSetupError as e:
                raise RewardSetupError(f"{e} (or reward.rule_weight: 0 to score with the reward model alone)") from None

    def close(self) -> None:
        for _, fn in self.parts:
            fn.close()


def with_reward_model(cfg, scorer: Optional[RewardFn], *, log: Callable[[str], None] = print) -> RewardFn:
    """The RewardFn of a Config with reward.model_path set: the reward model alone (``scorer`` None,
    reward.rule_weight 0) or ``reward.rule_weight * scorer + reward.model_weight * reward model``.
    The vocabulary and the checkpoint are checked before the model is built."""
    from pfppo_mega.models import hf_io
    from pfppo_mega.tokenizer import Tokenizer

    r, policy = cfg.reward, cfg.actor_rollout.model_path
    rm_hf = check_classifier(r.model_path)
    try:
        policy_hf = hf_io.read_hf_config(policy)
    except ModelDirError as e:
        raise RewardSetupError(f"actor_rollout.model_path {policy!r}: {e}") from None
    check_same_vocabulary(r.model_path, rm_hf, policy, policy_hf)
    tok = Tokenizer.from_dir(policy)
    model = RewardModel(r.model_path, encode=lambda text: tok.encode(text, add_bos=False), eos_id=tok.eos_id,
                        params_dtype=cfg.model.params_dtype, micro_batch_size=cfg.training.micro_batch_size,
                        max_length=cfg.data.max_prompt_length + cfg.algorithm.max_response_length, log=log)
    if scorer is None:
        return model if r.model_weight == 1.0 else WeightedReward([(r.model_weight, model)])
    return WeightedReward([(r.rule_weight, scorer), (r.model_weight, model)])
