#!/usr/bin/env bash
# Reproduces the shipped demo models: installs the Debian packages the recipe needs
# (corpus, digits data, torch), trains models/demo-vit, models/demo-lm and
# models/demo-dit (fixed seeds, one LibTorch thread each) and prints the time taken.
# demo-dit comes after demo-vit: its quality measure classifies with demo-vit. See
# training/README.md.
#   bash training/train_all.sh [OUT_DIR]     # default OUT_DIR: models
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-models}

# shellcheck source=scripts/install_deps.sh
. scripts/install_deps.sh  # defines install_missing, installs nothing
install_missing train_all python3 python3-torch python3-numpy python3-sklearn \
  python3-pil bible-kjv-text bible-kjv

# Debian's torch calls OpenBLAS; its threads must not compete with LibTorch's.
export OPENBLAS_NUM_THREADS=1
start=$(date +%s)
/usr/bin/python3 training/train_demo_vit.py --out "$out/demo-vit"
/usr/bin/python3 training/train_demo_lm.py --out "$out/demo-lm"
/usr/bin/python3 training/train_demo_dit.py --out "$out/demo-dit" --classifier "$out/demo-vit"
echo "train_all: demo-vit, demo-lm and demo-dit written to $out/ in $(( $(date +%s) - start )) s"
du -sh "$out/demo-vit" "$out/demo-lm" "$out/demo-dit"
