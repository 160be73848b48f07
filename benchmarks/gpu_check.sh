#!/usr/bin/env bash
# The GPU check of issue 55, prepared to fit in 8 minutes on one GPU (docs/benchmarks/gpu.md):
#
#   1. probe   host reads and aten operators per steady step, elastic against torch DDP, fused
#              AdamW, under torch.cuda.set_sync_debug_mode("error"): a step that waits for the GPU
#              fails (python -m benchmarks.probes.host_syncs --device cuda --sync-debug error)
#   2. probe-foreach   the same with foreach AdamW, counted only (it reads once per step by design)
#   3. overhead   steps/s against torch DDP at 1.3 M, 10.3 M and 102.7 M parameters, NCCL, fused
#              AdamW in both systems, 2 repetitions, elastic and torch DDP only
#              (python -m benchmarks overhead --gpu, ELASTIC_BENCH_OPTIMIZER=adamw-fused)
#   4. drills  FSDP with CPU offload, with meta init, and fp16, each killed mid-run and restored
#              from storage, bit-identical to an uninterrupted run (python -m benchmarks.probes.gpu_drills)
#
# Usage: benchmarks/gpu_check.sh [--cpu] [--out DIR]
#   --cpu      the same steps, small, on this machine's CPU (gloo, no GPU): a dry run of the script
#   --out DIR  where each step's JSON lines (STEP.jsonl), log (STEP.log) and results go
#              (default: a new folder under ${TMPDIR:-/tmp})
# Each step runs under its own time limit (their sum is 8 minutes on a GPU); a step cut short
# keeps what it printed. Steps 3 and 4 start a local Ray cluster: where Ray jobs share the
# machine, run the script under `flock /tmp/elastic-ray.lock`.
# Exit status: 0 when every step ended well, the probe counted no host read with fused AdamW and
# every drill ended bit-identical; 1 otherwise; 2 for a wrong argument.
set -u

usage() { sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; }

MODE=gpu
OUT=""
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu) MODE=cpu ;;
    --out) [ $# -ge 2 ] || { echo "gpu_check.sh: --out needs a folder" >&2; exit 2; }; OUT=$2; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument '$1' (give --cpu and/or --out DIR; --help)" >&2; exit 2 ;;
  esac
  shift
done

cd "$(dirname "$0")/.." || exit 2
PYTHON=${PYTHON:-python}
OUT=${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/gpu-check-XXXXXX")}
mkdir -p "$OUT" || exit 2
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
FAILED=""

# step NAME LIMIT_S COMMAND...: run it under its limit, its stdout in NAME.jsonl, stderr in NAME.log.
step() {
  local name=$1 limit=$2
  shift 2
  echo "== $name (at most ${limit} s): $*"
  local t0 rc
  t0=$(date +%s)
  timeout --signal=INT --kill-after=20 "$limit" "$@" >"$OUT/$name.jsonl" 2>"$OUT/$name.log"
  rc=$?
  grep '^{' "$OUT/$name.jsonl" | tail -n 3 | cut -c1-400  # the rest: in the file
  echo "== $name: exit $rc after $(( $(date +%s) - t0 )) s"
  if [ "$rc" -ne 0 ]; then
    FAILED="$FAILED $name"
    tail -n 15 "$OUT/$name.log"
  fi
}

{
  echo "{\"gpu_check\": \"$MODE\", \"commit\": \"$(git rev-parse --short HEAD 2>/dev/null)\", \"date\": \"$(date -u +%FT%TZ)\"}"
  if [ "$MODE" = gpu ]; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
  fi
} | tee "$OUT/machine.txt"

if [ "$MODE" = gpu ]; then
  step probe 60 "$PYTHON" -m benchmarks.probes.host_syncs --device cuda --sync-debug error
  step probe-foreach 40 "$PYTHON" -m benchmarks.probes.host_syncs --device cuda --optimizer adamw
  step overhead 230 env ELASTIC_BENCH_OPTIMIZER=adamw-fused "$PYTHON" -m benchmarks overhead --gpu \
    --hidden 1024,3072,10000 --reps 2 --systems elastic,torch-ddp --out "$OUT/overhead"
  step drills 150 "$PYTHON" -m benchmarks.probes.gpu_drills
else
  step probe 120 "$PYTHON" -m benchmarks.probes.host_syncs --hidden 64 --steps 4
  step probe-foreach 120 "$PYTHON" -m benchmarks.probes.host_syncs --hidden 64 --steps 4 --optimizer adamw
  step overhead 900 env ELASTIC_BENCH_OPTIMIZER=adamw-fused "$PYTHON" -m benchmarks overhead \
    --hidden 64,128,256 --reps 1 --systems elastic,torch-ddp --out "$OUT/overhead"
  step drills 900 "$PYTHON" -m benchmarks.probes.gpu_drills --cpu
fi

# The verdicts, from what the steps printed.
"$PYTHON" - "$OUT" <<'EOF' || FAILED="$FAILED verdicts"
import json, os, sys

out = sys.argv[1]


def lines(name):
    path = os.path.join(out, name + ".jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(x) for x in f if x.startswith("{")]


ok = True
probe = lines("probe")
reads = probe[-1]["host_reads_per_step"] if probe else None
ops = probe[-1]["ops_ratio"] if probe else None
print(f"probe (fused AdamW): {reads} host reads per step, ops_ratio {ops}")
ok &= reads == 0
other = lines("probe-foreach")
if other:
    print(f"probe (foreach AdamW): {other[-1]['host_reads_per_step']} host reads per step, "
          f"ops_ratio {other[-1]['ops_ratio']}")
summary = [r for r in lines("overhead") if r.get("summary")]
rows = summary[-1]["rows"] if summary else []
for r in rows:
    if r["system"] == "elastic":
        print(f"overhead {r['params'] / 1e6:.2f} M, checkpoints {r['checkpoints']}: elastic / torch "
              f"DDP {r['overhead_ratio']:.3f} ({r['reps']} reps)")
if not rows:
    print("overhead: no summary (cut short? its per-repetition lines are in overhead.jsonl)")
drills = [r for r in lines("drills") if "drill" in r]
for r in drills:
    print(f"drill {r['drill']} ({r['backend']}): identical {r.get('identical')}")
ok &= bool(drills) and all(r.get("identical") for r in drills)
sys.exit(0 if ok else 1)
EOF

echo "results in $OUT"
if [ -n "$FAILED" ]; then
  echo "gpu_check.sh: not passed:$FAILED"
  exit 1
fi
echo "gpu_check.sh: passed"
