"""Rollout TP 2 with the real vLLM under torchrun (2 processes, one engine over both ranks through
vLLM's external launcher), started by tests/test_vllm.py:

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/multirank/vllm_tp2.py MODEL_DIR OUT.json

Weights: the checkpoint perturbed with a fixed seed, sent by rank 0 as buckets broadcast over the
world group (the refit path), then one seeded generation; rank 0 writes tokens and log-probs.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pfppo_mega.models.hf_io import load_hf_state_dict  # noqa: E402
from pfppo_mega.rollout import SamplingParams  # noqa: E402
from pfppo_mega.rollout.vllm import VLLMEngine  # noqa: E402
from pfppo_mega.rollout.source import NamedTensorSource  # noqa: E402

PROMPTS = [[5, 9, 3], [7, 1, 4, 4, 12, 30, 2, 8], [11], [3, 3, 20, 21, 6]]
PARAMS = SamplingParams(1.0, 1.0, 16, None, seed=3)


def perturbed(model_dir) -> dict:
    gen = torch.Generator().manual_seed(77)
    return {n: t + 0.1 * torch.randn(t.shape, generator=gen) for n, t in load_hf_state_dict(model_dir).items()}


def main(model_dir: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # first: vLLM reuses it
    engine = VLLMEngine(model_dir, pad_token_id=0, tensor_parallel_size=2, max_num_seqs=8, log=lambda *_: None)
    source = NamedTensorSource(perturbed(model_dir).items(), 5, src=0)
    engine.bucket_bytes = 20_000
    engine.update_weights(source.buckets(engine.bucket_plan(), group=dist.group.WORLD), 5)
    res = engine.generate(PROMPTS, PARAMS)
    tokens = res.responses.tolist()
    everyone = [None, None]
    dist.all_gather_object(everyone, tokens)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({"tokens": tokens, "logprobs": res.logprobs.tolist(),
                                         "ranks_agree": everyone[0] == everyone[1], "start_s": engine.start_s}))
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
