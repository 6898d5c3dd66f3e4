#!/usr/bin/env bash
# The exact commands behind docs/ablations.md (Track 1). Run from the repository root after
# `speedrun prepare wiki-vital --tokenizer bpe:4096`. One torch thread per run: on a 2-core host shared
# with other jobs, two threads spin against each other (70 tok/s instead of 800 under a load of 12).
# The two ablate calls ran side by side; each trains its own baseline for the same seeds (so the
# baseline has two runs of every seed: a free look at the run-to-run nondeterminism).
set -euo pipefail
export OMP_NUM_THREADS=1
R=benchmarks/ablations/demo-gpt2026.toml
case "${1:-}" in
  single)  # one-key switches
    uptime
    python -m speedrun ablate --recipe $R --seeds 3 --out runs/abl-single \
      model.backout_layer=0 model.mimetic_vo_beta=0 'model.xsa_layers=[]' 'model.paired_layers=[]'
    uptime ;;
  multi)  # switches that need several keys ('+' joins them)
    uptime
    python -m speedrun ablate --recipe $R --seeds 3 --out runs/abl-multi \
      'model.bigram_rows=0+model.bigram_sign_rows=0' \
      'model.value_embeds=[]+model.ve_gate=0+model.ve_gate_ve_dims=0+model.value_embed_init_std=0' \
      'model.smear=0+optim.smear_gate_lr=0' \
      'model.mtp=0+train.stages=tokens=2048 windows=1/2 lr=1 frac=1/3; tokens=2048 windows=1/3 lr=1.52 frac=1/3; tokens=2048 windows=2/4 lr=1.73 frac=1/3; tokens=2048 windows=2/5 ext=4 val=2/5 yarn=5' \
      train.steps=50
    uptime ;;
  *) echo "usage: $0 single|multi" >&2; exit 2 ;;
esac
