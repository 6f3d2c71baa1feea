#!/usr/bin/env bash
# The seed paper's four experiments at CPU scale on small transformers models of its four
# families and of Llama (docs/transformers.md): (1)+(2) fault propagation unprotected and protected
# (abft campaign --model), (4) recovery by checkpoint/restore against protection (abft train
# --model), (3) the overhead of a training step (bench/hf_step.py).
# Usage: scripts/hf_experiments.sh OUT_DIR   (from the repository root, in the project's venv)
set -euo pipefail
out=${1:?usage: scripts/hf_experiments.sh OUT_DIR}
python=${PYTHON:-python}
mkdir -p "$out"
for model in bert roberta gpt2 gpt-neo llama; do
    "$python" -m attention campaign --model "$model" --kinds inf nan near-inf --trials 1 \
        --steps 5 --no-progress --out "$out/campaign-$model"
done
for model in gpt2 bert llama; do
    "$python" -m attention train --model "$model" --steps 100 --fault-rate 0.05 \
        --checkpoint-every 20 --no-progress --out "$out/train-$model"
done
"$python" bench/hf_step.py | tee "$out/hf_step.txt"
