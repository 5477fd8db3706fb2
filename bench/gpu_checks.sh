#!/usr/bin/env bash
# Every check that needs a CUDA GPU, as one prepared script (about 15 minutes on one H200: exactness 4.5,
# study 4, speed 6.5; name sections to stay within a shorter limit):
#   bash bench/gpu_checks.sh OUT_DIR [SECTION ...]   sections: exactness study speed demo-seeds, run in
#                                                    the order given (default: exactness study speed)
# It needs the shipped demo and the corpus (data/kjv.txt, from `python -m fca corpus`).
# OUT_DIR receives log.txt (everything printed), results.jsonl (one JSON object per measurement) and
# the study's archives (kjv-34m-study.tar.gz: the larger configuration's study and audits, as committed in
# cache/kjv-34m-study/: `tar -C cache -xzf OUT_DIR/kjv-34m-study.tar.gz` replaces them; with demo-seeds,
# demo-seedN-ARCH.tar.gz: trained models). A failing step is logged and the next one runs; the script
# exits 1 when any step failed, and 2 at once without a CUDA device or, for the sections that build caches
# or train, without the corpus (a machine that cannot run `python -m fca corpus` needs data/kjv.txt copied).
#
# exactness  the shipped CPU-built demo audited on CUDA (accepted, fidelity reported); caches built and
#            audited on CUDA (bit-identical); the drift between this machine's CPU and its GPU, float32
#            and bfloat16, both ways, and on other batches than the build's (fca.tables.fidelity's tolerances);
#            a small Mixtral's routing agreement against a NumPy count (bench/moe_routing_check.py)
# study      a larger configuration trained for three seeds, each with its Dense twin, cached and audited
# demo-seeds seeds 1 and 2 of the demo configuration trained on CUDA, as the shipped demo study's were (their
#            caches and audits are made on a CPU afterwards, like the shipped demo's)
# speed      the performance ratios on CUDA and MUDDPythia at the 1.4B shapes in bfloat16 (capture,
#            replay and a streamed cache build vs live); the writer's scaling: bench/writer_scale.py;
#            a host-bound forward beside a writer thread and process: bench/host_contention.py; what
#            handing a 1.4B-shaped batch to the writers costs the build's process: bench/handover.py; what
#            the routing tally adds to a replay of a 64-expert model: bench/moe_routing_check.py --cost
set -uo pipefail
out="${1:-gpu-checks}"
shift || true
sections="${*:-exactness study speed}"
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT  # also when a check below stops the script early
export PYTHONUNBUFFERED=1
exec > >(tee -a "$out/log.txt") 2>&1
demo=cache/demo
corpus=data/kjv.txt
failed=0

step() {  # step NAME SECONDS COMMAND...: run with a time limit, log its duration, go on after a failure
  local name=$1 limit=$2 start
  shift 2
  start=$(date +%s)
  echo "== $name"
  local status=0
  timeout "$limit" "$@" || status=$?
  if ((status != 0)); then echo "!! $name failed or timed out"; failed=$((failed + 1)); fi
  echo "== $name: $(($(date +%s) - start)) s"
  return $status  # (so that `step ... && record ...` records only what ran)
}
record() {  # record NAME JSON_FILE: append {"name": NAME, ...file} to results.jsonl
  [ -f "$2" ] && python -c "import json,sys; print(json.dumps({'name': sys.argv[1], **json.load(open(sys.argv[2]))}))" "$1" "$2" \
    >>"$out/results.jsonl"
}
drift() {  # drift NAME ARGS...: bench.fidelity_drift, recorded
  step "drift $1" 120 python -m bench.fidelity_drift --json "$work/$1.json" "${@:2}" && record "drift $1" "$work/$1.json"
}
build() {  # build DIR SPLIT DEVICE DTYPE NUM_SEQS [BUILD-CACHE OPTION ...]
  step "build $1" 240 python -m fca build-cache --model $demo/featuregate --corpus $corpus --split "$2" --out "$work/$1" \
    --device "$3" --dtype "$4" --num-seqs "$5" --batch 16 "${@:6}"
}
same_parts() {  # same_parts A B: two caches' parts are the same files (their hashes), both verified
  step "same parts: $1 and $2" 60 python -c "
import sys
from fca.tables.store import open_cache
a, b = (open_cache(path, verify=True).manifest.parts for path in sys.argv[1:])
assert [p.sha256 for p in a] == [p.sha256 for p in b], 'the caches differ'
print(len(a), 'identical parts')" "$work/$1" "$work/$2"
}

# FCA_CHECK_DEVICE=cpu runs the same steps on the CPU: a dry run of this script where there is no GPU.
gpu="${FCA_CHECK_DEVICE:-cuda}"
if [[ $gpu == cuda* ]]; then
  python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(), torch.__version__)" ||
    { echo "!! no CUDA device: nothing to check"; exit 2; }
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
fi
case " $sections " in
  *" exactness "* | *" study "* | *" demo-seeds "*)
    if [ ! -f "$corpus" ] && ! python -m fca corpus; then
      echo "!! $corpus is missing and could not be extracted: copy it here (sections: $sections)"
      exit 2
    fi
    ;;
esac

section_exactness() {
  step "demo audited on cuda" 240 python -m fca audit --model $demo/featuregate --cache $demo/eval --calibration $demo/calibration \
    --dense $demo/dense --device $gpu --json "$work/demo_cuda.json"
  record "audit: shipped demo (built on a CPU) on cuda" "$work/demo_cuda.json"
  build cuda/eval eval $gpu float32 128
  build cuda/calibration calibration $gpu float32 128
  step "cuda-built caches audited on cuda" 240 python -m fca audit --model $demo/featuregate --cache "$work/cuda/eval" \
    --calibration "$work/cuda/calibration" --device $gpu --json "$work/cuda_cuda.json"
  record "audit: caches built on cuda, on cuda" "$work/cuda_cuda.json"
  build cpu/eval eval cpu float32 64
  build cpu-bf16/eval eval cpu bfloat16 64
  build cuda-bf16/eval eval $gpu bfloat16 64
  m=$demo/featuregate
  drift cpu-to-cuda-fp32 --model $m --cache "$work/cpu/eval" --device $gpu
  drift cuda-to-cpu-fp32 --model $m --cache "$work/cuda/eval" --device cpu
  drift cpu-to-cuda-bf16 --model $m --cache "$work/cpu-bf16/eval" --device $gpu --dtype bfloat16
  drift cuda-to-cpu-bf16 --model $m --cache "$work/cuda-bf16/eval" --device cpu --dtype bfloat16
  drift cuda-other-batches-fp32 --model $m --cache "$work/cuda/eval" --device $gpu --batch 6
  drift cuda-other-batches-bf16 --model $m --cache "$work/cuda-bf16/eval" --device $gpu --dtype bfloat16 --batch 6
  drift demo-on-cuda-other-batches --model $m --cache $demo/eval --device $gpu --batch 6
  # A mixture of experts replayed here: its routing agreement against a NumPy count of the experts chosen.
  for dtype in float32 bfloat16; do
    step "moe routing on $gpu, $dtype" 180 python -m bench.moe_routing_check --device $gpu --dtype $dtype \
      --json "$work/moe-$dtype.json" && record "moe routing agreement, $dtype" "$work/moe-$dtype.json"
  done
}

section_demo_seeds() {
  # Seeds 1 and 2 of the demo configuration, trained here (bf16 autocast, fused AdamW). Their caches
  # and audits are made on a CPU afterwards, like the shipped demo's: `python -m fca demo-study`
  # finds the models in cache/demo-study/seedN/ (unpack the archives there) and skips training.
  for seed in 1 2; do
    for arch in featuregate dense; do
      step "train demo seed $seed $arch" 150 python -m fca train --arch $arch --seed $seed --device $gpu --corpus $corpus \
        --out "$work/demo-study/seed$seed/$arch"
      step "archive demo seed $seed $arch" 60 tar -C "$work/demo-study" -czf "$out/demo-seed$seed-$arch.tar.gz" "seed$seed/$arch"
    done
  done
}

section_study() {
  # A larger configuration (tens of millions of parameters) for three seeds, each with its Dense twin,
  # cached and audited here. The corpus is the 4 MB King James Bible: it limits what such a model learns.
  big=(--d-model 512 --layers 8 --heads 8 --mlp-groups 8 --seq-len 256 --vocab-size 8192 --steps 400)
  for seed in 0 1 2; do
    d="$work/kjv-34m-study/seed$seed"
    for arch in featuregate dense; do
      step "train big seed $seed $arch" 150 python -m fca train --arch $arch --seed $seed --device $gpu --corpus $corpus \
        --out "$d/$arch" "${big[@]}"
    done
    for split in eval calibration; do
      step "build big seed $seed $split" 120 python -m fca build-cache --model "$d/featuregate" --corpus $corpus --split $split \
        --out "$d/$split" --num-seqs 128 --device $gpu
    done
    step "audit big seed $seed" 150 python -m fca audit --model "$d/featuregate" --cache "$d/eval" --calibration "$d/calibration" \
      --dense "$d/dense" --device $gpu --json "$d/audit.json" --markdown "$d/audit.md"
    record "audit: larger configuration, seed $seed" "$d/audit.json"
  done
  local study="$work/kjv-34m-study"
  step "big study" 60 python -m fca study "$study"/seed*/audit.json --json "$study/study.json" --markdown "$study/study.md"
  record "study: larger configuration" "$study/study.json"
  step "archive the study" 60 tar -C "$work" -czf "$out/kjv-34m-study.tar.gz" kjv-34m-study/study.json kjv-34m-study/study.md \
    kjv-34m-study/seed{0,1,2}/audit.{json,md}
}

section_speed() {
  step "bench on cuda" 300 python -m fca bench --device $gpu --json "$work/bench_cuda.json"
  record "bench: demo model on cuda" "$work/bench_cuda.json"
  step "muddpythia 1.4b bf16" 360 python -m bench.muddpythia_scale --device $gpu --dtype bfloat16 --batch 8 --seq-len 1024 \
    --rounds 3 --stream-seqs 64 256 --stream-writers 4 8 --json "$work/mudd.json"
  record "muddpythia 1.4B shapes, bf16, 8 x 1024" "$work/mudd.json"
  step "writer scaling" 240 python -m bench.writer_scale --workers 1 2 4 8 --seqs 256 --repeats 3 --json "$work/writer.json"
  record "writer scaling, 1.4B-shaped coefficients" "$work/writer.json"
  step "host contention" 120 python -m bench.host_contention --json "$work/contention.json"
  record "host-bound forward beside a writer thread / process (this host's CPU)" "$work/contention.json"
  step "hand-over" 90 python -m bench.handover --workers 4 --json "$work/handover.json"
  record "handing a 1.4B-shaped batch to the writers (this host's CPU)" "$work/handover.json"
  step "routing tally cost" 180 python -m bench.moe_routing_check --cost --device $gpu --json "$work/moe-cost.json" &&
    record "replay with the routing tally / without (64 experts, top-8)" "$work/moe-cost.json"
}

for section in $sections; do
  case $section in
    exactness | demo-seeds | study | speed) "section_${section//-/_}" ;;
    *) echo "!! unknown section: $section"; failed=$((failed + 1)) ;;
  esac
done
echo "== done: $failed step(s) failed"
exit $((failed > 0))
