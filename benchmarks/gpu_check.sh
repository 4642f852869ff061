#!/usr/bin/env bash
# GPU checks for a lent CUDA machine (run from the repository root; results under $OUT).
# Records verbatim nvidia-smi outputs, runs gpus/pick-gpu/doctor against the real driver and checks
# ckptfix's cuda:N is torch's cuda:N by UUID, trains every mode on CUDA (single, AMP, DataParallel,
# DDP over nccl with SyncBatchNorm, FSDP2 DCP, hand-written all-reduce, torch.compile/inductor),
# loads each CUDA checkpoint on a CPU-only view with load_anywhere, and runs the `gpu`-marked tests.
# Small CUDA checkpoints come back as cuda_ckpts.tar.gz (fixtures for tests/fixtures/cuda/), every log as logs.tgz.
# Run there as: OUT=$OUT timeout 460 bash benchmarks/gpu_check.sh   (about 400 s on an H200; GPU_CHECK_QUICK=1: 90 s)
set -u
OUT=${OUT:-/tmp/gpu-check-out}
mkdir -p "$OUT"
W=$(mktemp -d)
PY=${PY:-python3}
log() { echo "== $*" | tee -a "$OUT/summary.txt"; }
step() {  # step NAME CMD...: run, record rc and time
    local name=$1; shift
    local t0=$EPOCHREALTIME
    "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    printf '%-28s rc=%-3s %6.1fs\n' "$name" "$rc" "$(awk "BEGIN{print $EPOCHREALTIME - $t0}")" | tee -a "$OUT/summary.txt"
}
$PY -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/pip.log" 2>&1 || log "pip -e failed"
CK="$PY -m ckptfix"
{
    log "nvidia-smi verbatim"
    F=index,uuid,pci.bus_id,name,memory.total,memory.used,memory.free,utilization.gpu,temperature.gpu,power.draw,mig.mode.current,compute_cap,clocks.max.sm,driver_version
    for args in "" "-L" "--query-gpu=$F --format=csv,nounits" "--query-gpu=$F --format=csv,noheader,nounits" \
                "--query-compute-apps=gpu_uuid,pid,process_name,used_memory --format=csv,nounits"; do
        echo "### nvidia-smi $args"; nvidia-smi $args; echo "### rc=$?"
    done
    echo "### LC_ALL=de_DE.UTF-8 nvidia-smi --query-gpu=power.draw --format=csv"
    LC_ALL=de_DE.UTF-8 nvidia-smi --query-gpu=power.draw,memory.used --format=csv
} >"$OUT/nvidia_smi_h200.txt" 2>&1
$PY - >"$OUT/torch_uuid.txt" 2>&1 <<'PYEOF'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "count", torch.cuda.device_count())
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(i, p.name, p.uuid, f"cc={p.major}.{p.minor}", p.total_memory)
print("arch_list", torch.cuda.get_arch_list())
PYEOF
step gpus $CK gpus
step gpus_json $CK gpus --json
step pick_gpu $CK pick-gpu --lease 0
step pick_gpu_json $CK pick-gpu --json --lease 0
step pick_gpu_exec $CK pick-gpu --lease 0 -- $PY -c "import os,torch;print(os.environ['CUDA_VISIBLE_DEVICES'], torch.cuda.device_count(), torch.cuda.get_device_properties(0).uuid)"
step doctor $CK doctor
step doctor_json $CK doctor --json
if [ -n "${GPU_CHECK_QUICK:-}" ]; then  # the GPU commands and the gpu-marked tests only (about 90 s)
    step pytest_gpu $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_real.py tests/test_cuda_fixtures.py
    step gpus_watch timeout -s INT 3 $CK gpus --watch 1
    step pick_gpu_exclude $CK pick-gpu --lease 0 --exclude 0
    step pick_gpu_maxtemp $CK pick-gpu --lease 0 --max-temp 90 --max-power 650 --json
    step sigpipe $CK pick-gpu --lease 0 -- sh -c 'yes | head -1'
    cat "$OUT/summary.txt"
    (cd "$OUT" && tar czf logs.tgz --remove-files ./*.log ./*.txt 2>/dev/null)
    exit 0
fi
R=$W/runs
step train_single $CK train --mode single --device cuda --out $R --epochs 2 -q
step train_single_amp $CK train --mode single --device cuda --amp --out $R --epochs 1 -q
step train_dp $CK train --mode dp --device cuda --out $R --epochs 1 -q
step train_ddp_nccl_resnet $CK train --mode ddp --nproc 1 --device cuda --model resnet --out $R --epochs 1 -q
step train_ddp_amp $CK train --mode ddp --nproc 1 --device cuda --amp --out $R --epochs 1 -q
step train_fsdp $CK train --mode fsdp --nproc 1 --device cuda --out $R --epochs 1 -q
step train_manual $CK train --mode manual --replicas 1 --device cuda --model tutorial --lr 0.2 --momentum 0 --batch-size 256 --out $R --epochs 2 -q
step train_compile $CK train --mode single --device cuda --compile --compile-backend inductor --out $R --epochs 1 -q
step train_tutorial_single $CK train --mode single --device cuda --model tutorial --momentum 0 --lr 0.2 --batch-size 256 --epochs 5 --out $R -q
cp $R/checkpoints.json "$OUT/" 2>/dev/null
ls -la $R >"$OUT/runs_ls.txt"
# every CUDA checkpoint: plain torch on a CPU-only view fails, ckptfix inspects and loads it
for f in $R/*.pt $R/*.dcp; do
    [ -e "$f" ] || continue
    b=$(basename "$f")
    echo "### $b" >>"$OUT/cpu_view.txt"
    CUDA_VISIBLE_DEVICES= $PY -c "import torch,sys; torch.load(sys.argv[1], weights_only=False)" "$f" 2>&1 | tail -1 >>"$OUT/cpu_view.txt"
    $CK inspect "$f" >>"$OUT/cpu_view.txt" 2>&1; echo "inspect rc=$?" >>"$OUT/cpu_view.txt"
    CUDA_VISIBLE_DEVICES= $PY -c "
import sys
from ckptfix import load_anywhere
sd = load_anywhere(sys.argv[1])
print('load_anywhere ok', type(sd).__name__, len(sd))" "$f" >>"$OUT/cpu_view.txt" 2>&1
    echo "load rc=$?" >>"$OUT/cpu_view.txt"
done
step pytest_gpu $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_real.py tests/test_train.py -x
step pytest_gpu_all $PY -m pytest -q -p no:cacheprovider -m gpu --continue-on-collection-errors
(cd $R && tar czf "$OUT/cuda_ckpts.tar.gz" --exclude='*.probe.pt' $(ls | grep -E '\.(pt|dcp)$|checkpoints.json' | head -20)) 2>>"$OUT/summary.txt"
cat "$OUT/summary.txt"
# the device tool brings back at most 8 files: every log in one archive
(cd "$OUT" && tar czf logs.tgz --remove-files ./*.log ./*.txt ./checkpoints.json 2>/dev/null)
