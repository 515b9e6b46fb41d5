#!/usr/bin/env bash
# Same seed, same config, two commits: 20-step runs of configs/tiny_cpu.yaml for plain PPO and
# PF-PPO x the builtin and vLLM engines x trainer TP 1 and 2, then scripts/compare_metrics.py.
#   bash scripts/bit_identity.sh BASE_COMMIT [OUT] [-- --ignore PREFIX ...]   (after `make setup`; ~4 min)
set -euo pipefail
BASE=${1:?usage: bit_identity.sh BASE_COMMIT [OUT]}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${2:-$ROOT/runs/bit_identity}
shift $(( $# < 2 ? $# : 2 )); [ "${1:-}" = "--" ] && shift
PY=$ROOT/.venv/bin/python
export HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1
rm -rf "$OUT" && mkdir -p "$OUT"
git -C "$ROOT" worktree add --detach "$OUT/base-src" "$BASE" >/dev/null
cp "$ROOT"/pfppo_mega/_C*.so "$OUT/base-src/pfppo_mega/"
(cd "$ROOT" && PYTHONPATH=$ROOT $PY -m pfppo_mega sft configs/tiny_cpu.yaml parallel.tp=1 sft.output_dir="$OUT/sft" >"$OUT/sft.log" 2>&1)
for side in base head; do
  src=$([ $side = base ] && echo "$OUT/base-src" || echo "$ROOT")
  for algo in ppo pfppo; do for eng in builtin vllm; do for tp in 1 2; do
    name=${algo}_${eng}_tp$tp
    args=(configs/tiny_cpu.yaml actor_rollout.model_path="$OUT/sft" actor_rollout.engine=$eng
          algorithm.use_pf_ppo=$([ $algo = pfppo ] && echo true || echo false) parallel.tp=$tp
          training.total_training_steps=20 logging.output_dir="$OUT/$side/$name" checkpoint.resume=false
          logging.eval_interval=10 actor_rollout.temperature=0.9)
    launch=(-m pfppo_mega train); [ $tp = 2 ] && launch=(-m torch.distributed.run --nproc_per_node=2 -m pfppo_mega train)
    (cd "$src" && PYTHONPATH=$src $PY "${launch[@]}" "${args[@]}" >"$OUT/$side-$name.log" 2>&1) || { echo "$side $name failed: $OUT/$side-$name.log"; exit 1; }
  done; done; done
done
git -C "$ROOT" worktree remove --force "$OUT/base-src"
$PY "$ROOT/scripts/compare_metrics.py" "$OUT/base" "$OUT/head" "$@"
