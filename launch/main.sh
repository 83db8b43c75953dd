#!/usr/bin/env bash
# The main job: GRPO on a tiny Qwen3, ZeRO-3 on 2 CPU ranks under the `deepspeed` runner, one engine per
# cast mode (fp32 reference, nearest, stochastic, dither, error_feedback) and seed. Options go to the job:
#   bash launch/main.sh                       # the paper regime (default), 1 seed x 500 steps
#   bash launch/main.sh --full                # the paper regime's committed run: 8 seeds (docs/grpo/paper/)
#   bash launch/main.sh --regime large-step   # the earlier lr-1e-4 job (--full: its 5 seeds)
#   bash launch/main.sh --seeds 3 --steps 200 --name mine
#   bash launch/main.sh --seed-list 8-19 --modes fp32,nearest,dither --lr 3e-6 --steps 250 --init-std 0.05
#   bash launch/main.sh --off-grid            # masters start at a seeded random point inside their bf16 cell
#   bash launch/main.sh --engine vllm   # rollouts from a real vLLM engine fed the served weights (docs/vllm.md)
#   bash launch/main.sh --model smollm2-135m-instruct --task addition   # the pretrained SmolLM2-135M-Instruct
#       (docs/pretrained.md): fp32, nearest, dither; 4 prompts x 4 completions from `vllm serve`; resumable:
#       give --out/--name and run the same command again to continue (--session-steps N stops after N steps)
# Every option and its check: faircast_jobs/config.py, `python3 -m faircast_jobs.grpo --help`.
# Wall times are in docs/grpo.md.
# JOB=staleness runs the older served-weights-changed-per-step job instead.
set -euo pipefail
cd "$(dirname "$0")/.."
export DS_ACCELERATOR=cpu
ranks="${NUM_RANKS:-2}"
threads=$(( $(nproc) / ranks ))
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( threads > 0 ? threads : 1 ))}"
exec deepspeed --num_gpus "$ranks" --master_port "${MASTER_PORT:-29500}" --module "faircast_jobs.${JOB:-grpo}" "$@"
