"""Held-out evaluation and the on-policy KL probe, both with the current weights in the engine."""

from __future__ import annotations

import torch

from pfppo_mega import ppo
from pfppo_mega.rollout import SamplingParams
from pfppo_mega.trainer.batch import PackedInputs, pack
from pfppo_mega.trainer.build import Run
from pfppo_mega.trainer.instruments import devicecheck
from pfppo_mega.trainer.passes import policy_logp, reference_logp
from pfppo_mega.trainer.seeds import stream_seed


def evaluate(run: Run) -> dict[str, float]:
    """Held-out accuracy of the current weights: sampled at the rollout temperature (the
    policy's own success rate, seeded) and greedy."""
    cfg, step, samples = run.cfg, run.state.step, run.eval_samples
    prompts = [list(s.prompt_ids) for s in samples]
    sources = sorted({s.data_source for s in samples})
    ar = cfg.actor_rollout
    guards = run.state.guards
    out, gens = {}, {}
    with run.gen.colocated(step, refit=True):  # the engine may hold a behaviour snapshot
        for key, greedy in (("eval/accuracy", False), ("eval/accuracy_greedy", True)):
            params = SamplingParams(temperature=ar.temperature, top_p=ar.top_p, greedy=greedy,
                                    max_new_tokens=cfg.algorithm.max_response_length,
                                    eos_token_id=run.tokenizer.eos_id, seed=stream_seed("eval", cfg.training.seed))
            gens[key] = run.gen.run_engine(prompts, params, step=step, what=f"evaluation at step {step}",
                                           replicated=True)
    for key, gen in gens.items():
        # Same guard as training: a bad reward scores 0 and is counted (every rank evaluates the
        # same prompts, so the counts are already global).
        texts = [run.tokenizer.decode(r[: int(l)].tolist()) for r, l in zip(gen.responses, gen.lengths)]
        guarded = run.reward_fn(samples, texts, gen.finished.tolist())
        guards["bad_rewards"] += guarded.nonfinite
        guards["reward_errors"] += guarded.errors
        guards["reward_timeouts"] += guarded.timeouts
        out[key] = float(guarded.scores.double().sum()) / len(samples)
        suffix = key.split("/", 1)[1].removeprefix("accuracy")  # "" or "_greedy"
        if guarded.honest is not None:  # reward.shaping: the honest metric apart from the trained-on
            out[f"eval/honest_accuracy{suffix}"] = float(guarded.honest.double().sum()) / len(samples)
        out[f"eval/length_mean{suffix}"] = float(gen.lengths.double().mean())
        for ds in sources:  # per data_source: eval/<data_source>/accuracy[_greedy]
            rows = [i for i, s in enumerate(samples) if s.data_source == ds]
            out[f"eval/{ds}/{key.split('/', 1)[1]}"] = float(guarded.scores[rows].double().mean())
    return out


@torch.no_grad()
def kl_probe(run: Run) -> float:
    """KL(current || reference) per token on fresh samples of the current policy (held-out
    prompts, fixed seed): the same estimator whichever behaviour policies trained it."""
    cfg, step = run.cfg, run.state.step
    ar = cfg.actor_rollout
    prompts = [list(s.prompt_ids) for s in run.eval_samples[: cfg.logging.kl_probe_size]]
    params = SamplingParams(temperature=ar.temperature, top_p=ar.top_p,
                            max_new_tokens=cfg.algorithm.max_response_length, eos_token_id=run.tokenizer.eos_id,
                            seed=stream_seed("kl_probe", cfg.training.seed, step=step))
    with run.gen.colocated(step, refit=True), devicecheck.paused():
        out = run.gen.run_engine(prompts, params, step=step, what=f"KL probe at step {step}", replicated=True)
    devicecheck.mark_host(out.responses, out.response_mask)
    inp = pack(prompts, out.responses, out.response_mask, pad_id=run.tokenizer.pad_id, device=run.device)
    logp, _ = policy_logp(run, run.actor, inp)
    ref, _ = reference_logp(run, inp)
    return ppo.masked_mean(logp - ref, inp.response_mask).item()
