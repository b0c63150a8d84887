#!/usr/bin/env bash
# The README's demo: train 20 steps saving through ckptd, then "restart" the job for 40
# steps: it resumes from step 20. Uses $CKPTD_SOCKET if set, else starts a local daemon.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
ckpt_dir=${CKPT_DIR:-/tmp/ckptd-demo-$(id -u)}
rm -rf "$ckpt_dir"
echo "== first run: steps 1-20, checkpoints in $ckpt_dir"
python3 -m torch.distributed.run --nproc-per-node 2 "$here/train.py" --ckpt-dir "$ckpt_dir" --steps 20
echo "== second run: resumes from the latest checkpoint and trains to step 40"
python3 -m torch.distributed.run --nproc-per-node 2 "$here/train.py" --ckpt-dir "$ckpt_dir" --steps 40
