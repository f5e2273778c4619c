#!/usr/bin/env bash
# The checks that need a CUDA GPU (CI has none; run them by hand where one is lent):
#   1. the CUDA tests (tests/c10d/test_cuda*.py and the GPU cases of tests/algorithms), which
#      skip without a GPU;
#   2. examples/train_sharded_diloco.py with --device cuda: NCCL inside each replica, pccl
#      across, a replica joining late and one SIGKILLed, bit-identical at the end.
# NCCL refuses two ranks of one group on one GPU, so on a machine of G GPUs each replica runs
# min(G, 2) shards.
#
# For a machine with no network: Python wheels its image lacks may wait in .whl/ and
# OpenSSL's headers (Debian's libssl-dev, unpacked: .ossl/include) in .ossl/; both optional.
# Writes its logs and the example's summary.json to $OUT (default /tmp/gpu_checks).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_checks}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
py=python3
if compgen -G ".whl/*.whl" >/dev/null; then
    $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if [ ! -e /usr/include/openssl/evp.h ] && [ -d .ossl/include ]; then
    # Headers only; link against the system's libcrypto.so.3 through a dev-style symlink.
    mkdir -p /tmp/ossl-lib
    ln -sf "$(ldconfig -p | awk '/libcrypto.so.3 /{print $NF; exit}')" /tmp/ossl-lib/libcrypto.so
    export CFLAGS="-I$PWD/.ossl/include -I$PWD/.ossl/include/x86_64-linux-gnu" LDFLAGS="-L/tmp/ossl-lib"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
$py -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'gpus', torch.cuda.device_count(), 'nccl', torch.cuda.nccl.version())"
# The entry point registers backend="pccl" at `import torch`, so install, not only build.
$py -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$OUT/build.log" 2>&1 \
    || { tail -30 "$OUT/build.log"; exit 1; }
status=0
$py -m pytest -q -rs -p no:cacheprovider tests/c10d/test_cuda.py tests/c10d/test_cuda_fidelity.py \
    tests/algorithms/test_diloco.py tests/algorithms/test_quorum.py -k "cuda or gpu" \
    2>&1 | tee "$OUT/cuda_tests.log" | tail -15 || status=1
gpus=$($py -c "import torch; print(torch.cuda.device_count())")
shards=$(( gpus < 2 ? 1 : 2 ))
# A GPU runs the 400 default steps in seconds, before a late torchrun gets going: 2400 steps.
timeout 420 $py examples/train_sharded_diloco.py --device cuda --shards "$shards" --no-progress \
    --steps 2400 --eval-every 400 --late-join-replica 100 --kill-shard 1800 --out-dir "$OUT/sharded" \
    >"$OUT/sharded.log" 2>&1 || status=1
tail -4 "$OUT/sharded.log"
exit $status
