"""Held-out evaluation and the on-policy KL probe, both with the current weights in the engine."""

from __future__ import annotations

import torch

from pfppo_mega import ppo
from pfppo_mega.config import Config
from pfppo_mega.rollout import SamplingParams
from pfppo_mega.tokenizer import Tokenizer
from pfppo_mega.trainer.batch import pack
from pfppo_mega.trainer.build import Models, TrainState
from pfppo_mega.trainer.colocation.generation import Generation
from pfppo_mega.trainer.instruments import devicecheck
from pfppo_mega.trainer.passes import policy_logp, reference_logp
from pfppo_mega.trainer.seeds import stream_seed
from pfppo_mega.types import RewardFn, Sample


def evaluate(samples: list[Sample], *, cfg: Config, gen: Generation, tokenizer: Tokenizer, reward_fn: RewardFn,
             state: TrainState) -> dict[str, float]:
    """Held-out accuracy of the current weights on ``samples``: sampled at the rollout temperature
    (the policy's own success rate, seeded) and greedy. The reward guard's counts go to ``state``."""
    step = state.step
    prompts = [list(s.prompt_ids) for s in samples]
    sources = sorted({s.data_source for s in samples})
    ar = cfg.actor_rollout
    guards = state.guards
    out, gens = {}, {}
    with gen.colocated(step, refit=True):  # the engine may hold a behaviour snapshot
        for key, greedy in (("eval/accuracy", False), ("eval/accuracy_greedy", True)):
            params = SamplingParams(temperature=ar.temperature, top_p=ar.top_p, greedy=greedy,
                                    max_new_tokens=cfg.algorithm.max_response_length,
                                    eos_token_id=tokenizer.eos_id, seed=stream_seed("eval", cfg.training.seed))
            what = f"evaluation at step {step}"
            if gen.turns is not None:  # multi-turn: the held-out rows as conversations with the tools too
                gens[key] = gen.conversations(samples, params, step=step, what=what, replicated=True, record=False)
            else:
                o = gen.run_engine(prompts, params, step=step, what=what, replicated=True)
                gens[key] = (o, [tokenizer.decode(r[: int(n)].tolist()) for r, n in zip(o.responses, o.lengths)],
                             samples)
    for key, (out_k, texts, rows) in gens.items():
        # Same guard as training: a bad reward scores 0 and is counted (every rank evaluates the
        # same prompts, so the counts are already global).
        guarded = reward_fn(rows, texts, out_k.finished.tolist())
        guards["bad_rewards"] += guarded.nonfinite
        guards["reward_errors"] += guarded.errors
        guards["reward_timeouts"] += guarded.timeouts
        out[key] = float(guarded.scores.double().sum()) / len(samples)
        suffix = key.split("/", 1)[1].removeprefix("accuracy")  # "" or "_greedy"
        if guarded.honest is not None:  # reward.shaping: the honest metric apart from the trained-on
            out[f"eval/honest_accuracy{suffix}"] = float(guarded.honest.double().sum()) / len(samples)
        out[f"eval/length_mean{suffix}"] = float(out_k.lengths.double().mean())
        for ds in sources:  # per data_source: eval/<data_source>/accuracy[_greedy]
            rows = [i for i, s in enumerate(samples) if s.data_source == ds]
            out[f"eval/{ds}/{key.split('/', 1)[1]}"] = float(guarded.scores[rows].double().mean())
    return out


@torch.no_grad()
def kl_probe(samples: list[Sample], *, cfg: Config, gen: Generation, models: Models, tokenizer: Tokenizer,
             step: int, device: torch.device) -> float:
    """KL(current || reference) per token on fresh samples of the current policy (the first
    logging.kl_probe_size of the held-out ``samples``, fixed seed): the same estimator whichever
    behaviour policies trained it."""
    ar = cfg.actor_rollout
    prompts = [list(s.prompt_ids) for s in samples[: cfg.logging.kl_probe_size]]
    params = SamplingParams(temperature=ar.temperature, top_p=ar.top_p,
                            max_new_tokens=cfg.algorithm.max_response_length, eos_token_id=tokenizer.eos_id,
                            seed=stream_seed("kl_probe", cfg.training.seed, step=step))
    with gen.colocated(step, refit=True), devicecheck.paused():
        out = gen.run_engine(prompts, params, step=step, what=f"KL probe at step {step}", replicated=True)
    devicecheck.mark_host(out.responses, out.response_mask)
    inp = pack(prompts, out.responses, out.response_mask, pad_id=tokenizer.pad_id, device=device)
    kw = dict(temperature=ar.temperature, training=cfg.training, kernels=models.kernels)
    logp, _ = policy_logp(models.actor, inp, **kw)
    ref, _ = reference_logp(models.actor, models.ref, inp, **kw)
    return ppo.masked_mean(logp - ref, inp.response_mask).item()
