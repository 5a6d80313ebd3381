#!/usr/bin/env bash
# One prepared run of duplexd's GPU checks on a lent machine (one NVIDIA GPU, no network), from the repo root:
#   0. install: the wheels of .whl/ (bench/gpu_wheels.sh, run beforehand where there is network) into a scratch
#      --target on PYTHONPATH, then duplexd itself with --no-build-isolation --no-deps;
#   1. the capacity sweep (bench/gpu_capacity.py: moshi-7b, random bf16 weights, full 3000-frame windows, the grid
#      1 8 32 48 64 72 80 then bisection up to what the KV pool admits);
#   2. the Triton kernel table (bench/gpu_kernels.py);
#   2b. where a step goes (bench/gpu_profile.py: moshi-7b at batch 1 and 80 with bf16 KV and 128 with int8 KV, full
#      windows: each part's share of the eager step, profiled, against its floor (the bytes it must move over the
#      measured copy bandwidth), and the captured step's time; 120 s at most);
#   3. `duplexd serve --random-weights moshi-7b` with --max-sessions at the capacity found, and
#      `duplexd loadtest --protocol realtime` with that many sessions for 45 s against it;
#   4. the persona prompt prefill (bench/prompt_prefill.py: PersonaPlex 7B's config, random bf16 weights, the real
#      Mimi config: time from session open to the first live output with a 200-frame prompt, prefilled against one
#      frame per step, at batch 1 and beside 8 live sessions; goal <= 150 ms);
#   5. the 8-bit KV cache (bench/kv_dtype.py: sessions that fit at bf16 and int8, the Triton store against the
#      torch reference for int8 and fp8, teacher-forced text-logit agreement of int8 against bf16 KV over 3100
#      frames, p50/p99 step at 1, 64, 128 and 156 sessions in full windows for each), in what is left of the budget;
#   6. 8-bit weights (bench/weights_dtype.py: each W8A16 kernel (tiles, gemv) against bf16 `x @ w`, a copy of the
#      codes and each other at Moshi 7B's decode shapes, M 1 8 64, checked against the torch reference; p50/p99 step
#      at 1, 8 and 64 sessions in full windows with bf16 weights and int8 with each kernel, and their ratios, goal
#      <= 0.75 at batch 1; teacher-forced text and first-codebook logit agreement of int8 weights, text head int8
#      and float, against bf16), in what is left;
#   7. speech-to-text streams (bench/gpu_capacity.py on Kyutai STT 1B: random bf16 weights, its real config, Mimi
#      at 32 codebooks, every session at the end of its 750-frame window: the most streams with p99 step <= 80 ms,
#      goal >= 600; moshi-server's figure is 400 on an H100), in what is left, into stt/;
#   7b. text-to-speech streams (bench/gpu_tts.py: Kyutai TTS 1.6B's config, random bf16 weights, words streamed at
#      10 a second, 1 32 64 128 streams: p99 step and time to first audio; goal >= 128 real-time with first audio
#      p50 <= 150 ms), in what is left;
#   8. summary.md with every table (stage 6's tables are in weights_dtype.log and printed after it); the short
#      summary is printed last.
# A second call on the same warm machine, SUITE_STAGES="capacity_int8 capacity_paged": the capacity sweep with int8 KV
# up to 160 sessions (CAPACITY_INT8_ARGS), into int8/, and the bf16 sweep again with `--attention-kernel paged`
# (CAPACITY_PAGED_ARGS), into paged/, the decode attention's A/B beside the first call's "split".
# Where .triton-sm90/ was carried (bench/gpu_triton_cache.py, compiled here for sm_90 by the image's Triton), the
# stages read their kernels from it; triton_cache.log says whether its key matched and how many kernels compiled.
# Everything goes into one folder: $OUT if set, else bench/out/gpu-<date>. Each stage runs under its own timeout,
# and all of them under SUITE_BUDGET seconds (default 560; 2400 for a dry run), so one stage hanging cannot eat the
# rest. The exit status is that of the first stage that failed (0 when all passed).
#
# GPU_SUITE_DRY=1 runs the same stages on the CPU with the demo preset and tiny durations (a check of this script;
# the load test's late-frame and first-audio limits are lifted there: a shared CPU cannot keep a GPU's pace).
# Other knobs: PYTHON (default /opt/torch/.venv/bin/python3 if present, else python3), WHEELS (default .whl),
# SITE (default /tmp/duplexd-site), DEVICE, LOAD_SECONDS, CAPACITY_ARGS (replaces the sweep's arguments),
# PREFILL_ARGS (replaces the prompt prefill bench's arguments), KV_ARGS (replaces the 8-bit KV bench's arguments),
# W8_ARGS (replaces the 8-bit weights bench's arguments), STT_ARGS (replaces the STT streams' arguments),
# TTS_ARGS (replaces the TTS streams' arguments), PROFILE_ARGS (replaces the step profile's arguments),
# SUITE_STAGES (some of: capacity kernels profile serve kv w8 stt tts prefill; install and the summary always run),
# SERVE_SESSIONS (serve at this many sessions, not at the capacity the sweep found).
set -uo pipefail

cd "$(dirname "$0")/.."
REPO=$(pwd)
STARTED=$(date +%s)
DRY=${GPU_SUITE_DRY:-0}
if [ -z "${PYTHON:-}" ]; then
  PYTHON=python3
  [ -x /opt/torch/.venv/bin/python3 ] && PYTHON=/opt/torch/.venv/bin/python3
fi
case "$PYTHON" in */*) PYTHON=$(cd "$(dirname "$PYTHON")" && pwd)/$(basename "$PYTHON") ;; esac  # stages cd elsewhere
WHEELS=${WHEELS:-.whl}
SITE=${SITE:-/tmp/duplexd-site}
DIR=${OUT:-bench/out/gpu-$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$DIR" && DIR=$(cd "$DIR" && pwd)
STAGES="$DIR/stages.tsv"
: > "$STAGES"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 DUPLEXD_CACHE=${DUPLEXD_CACHE:-/tmp/duplexd-cache}
# Triton kernels compiled beforehand for sm_90 (bench/gpu_triton_cache.py, carried as .triton-sm90): Triton's cache
# index names each file by the absolute path it was written under, so the cache is reached through that same path.
TRITON_CACHE=""
if [ "$DRY" != 1 ] && [ -z "${TRITON_CACHE_DIR:-}" ] && [ -f "$REPO/.triton-sm90/manifest.json" ]; then
  TRITON_CACHE=/tmp/duplexd-triton-sm90
  rm -rf "$TRITON_CACHE" && ln -s "$REPO/.triton-sm90" "$TRITON_CACHE"
  export TRITON_CACHE_DIR=$TRITON_CACHE
fi

if [ "$DRY" = 1 ]; then
  PRESET=demo DEVICE=${DEVICE:-cpu} LOAD_SECONDS=${LOAD_SECONDS:-5}
  DEFAULT_CAPACITY="--preset demo --device $DEVICE --batches 1 2 4 --steps 20 --max-sessions 4 --granularity 1 --budget-ms 1000"
  DEFAULT_PREFILL="--preset demo --device $DEVICE --quick --threads 1 --no-reference"
  DEFAULT_KV="--preset demo --device $DEVICE --frames 200 --rows 2 --batches 1 2 --steps 5"
  DEFAULT_W8="--preset demo --device $DEVICE --stages kernel steps agreement --frames 40 --rows 2 --batches 1 2
    --steps 5 --repeats 5"
  DEFAULT_STT="--preset demo-stt --device $DEVICE --batches 1 2 4 --steps 10 --max-sessions 4 --granularity 1
    --budget-ms 1000 --position 31"
  DEFAULT_TTS="--preset demo-tts --device $DEVICE --dtype float32 --batches 1 2 --steps 25"
  DEFAULT_PROFILE="--preset demo --device $DEVICE --runs 1:bf16 2:int8 --warmup 1 --steps 1 --timed 3 --kernels"
  # A shared CPU (the load test's clients on the server's cores) cannot keep the GPU's pace: the dry run checks
  # that every session is served, not how late its frames are.
  LOAD_CHECKS="--max-late-frac 1 --max-ttfa-ms 10000 --max-refused 0 --max-errors 0"
  # Its limits only stop a hung stage: on a shared CPU under load a stage takes a minute for a free core's seconds.
  BUDGET=${SUITE_BUDGET:-2400}
  T_INSTALL=240 T_KERNELS=240 T_CAPACITY=240 T_PREFILL=240 T_READY=240 T_KV=240 T_W8=240 T_STT=240 T_TTS=240
  T_PROFILE=240 T_CAPACITY_INT8=240 T_CAPACITY_PAGED=240
  DEFAULT_CAPACITY_INT8="$DEFAULT_CAPACITY --kv-dtype int8"
  DEFAULT_CAPACITY_PAGED="$DEFAULT_CAPACITY --attention-kernel paged"
  MIN_install=0 MIN_capacity=20 MIN_kernels=20 MIN_serve=$((LOAD_SECONDS + 20)) MIN_prefill=20 MIN_kv=20 MIN_w8=20
  MIN_stt=20 MIN_tts=20 MIN_profile=20 MIN_capacity_int8=20 MIN_capacity_paged=20
else
  PRESET=moshi-7b DEVICE=${DEVICE:-cuda:0} LOAD_SECONDS=${LOAD_SECONDS:-45}
  DEFAULT_CAPACITY="--preset moshi-7b --device $DEVICE --batches 1 8 32 48 64 72 80 --steps 120 --granularity 4"
  # Batch 1 three times, then one round beside 8 live sessions (a partial JSON line is printed in between, so a
  # stage cut short still reports batch 1).
  DEFAULT_PREFILL="--preset personaplex-7b --device $DEVICE --dtype bfloat16 --repeats 3 --live 8 --live-repeats 1
    --baseline-s 2"
  # 156: the most full windows an H200's pool holds in int8, the issue's real-time goal
  DEFAULT_KV="--preset moshi-7b --device $DEVICE --kv-dtype int8 --frames 3100 --rows 4 --batches 1 64 128 156
    --steps 60"
  # Kernel table first (seconds), then three engines (bf16, int8 with tiles, int8 with gemv; graph capture each),
  # then 200 teacher-forced frames of three 7B models; weights_dtype.json is rewritten after each stage, so a cut
  # leaves the earlier ones.
  DEFAULT_W8="--preset moshi-7b --device $DEVICE --stages kernel steps agreement --batches 1 8 64 --steps 40
    --repeats 50 --frames 200 --rows 4"
  # 100 timed steps a batch (a p99 near the maximum, said so), bisection over multiples of 32 up to 1024 slots
  DEFAULT_STT="--preset stt-1b --device $DEVICE --batches 1 64 256 400 512 640 --steps 100 --granularity 32
    --max-sessions 1024 --position 749"
  # Kyutai TTS 1.6B, random bf16 weights, words streamed at 10 a second (the first three at once)
  DEFAULT_TTS="--preset tts-1.6b --device $DEVICE --batches 1 32 64 128 --steps 100"
  # Batch 1 and 80 with bf16 KV, 128 with int8 KV (what fits): 2 eager steps profiled, 20 timed eagerly and as a
  # graph; gpu_profile.json is rewritten after each batch, so a cut leaves the earlier ones.
  DEFAULT_PROFILE="--preset moshi-7b --device $DEVICE --runs 1:bf16 80:bf16 128:int8 --warmup 3 --steps 2 --timed 20"
  LOAD_CHECKS="--max-late-frac 0.01 --max-ttfa-ms 300 --max-refused 0 --max-errors 0"
  BUDGET=${SUITE_BUDGET:-560}
  T_INSTALL=60 T_KERNELS=200 T_CAPACITY=240 T_PREFILL=60 T_READY=120 T_KV=190 T_W8=130 T_STT=120 T_TTS=120
  T_PROFILE=120 T_CAPACITY_INT8=240 T_CAPACITY_PAGED=200
  # The second call's stages: capacity with int8 KV up to 160 sessions (what its pool admits), and the bf16 sweep
  # again with the "paged" decode attention for the A/B against the first call's "split" (same grid, same machine).
  DEFAULT_CAPACITY_INT8="--preset moshi-7b --device $DEVICE --kv-dtype int8 --batches 1 64 96 128 144 160 --steps 120
    --granularity 4 --max-sessions 160"
  DEFAULT_CAPACITY_PAGED="$DEFAULT_CAPACITY --attention-kernel paged"
  # The least a stage needs to say something (a stage cut short still reports what it finished): what the stages
  # before it leave aside for it (the profile's: the 7B model drawn and batch 1).
  MIN_install=0 MIN_capacity=90 MIN_kernels=45 MIN_serve=$((LOAD_SECONDS + 70)) MIN_prefill=30 MIN_kv=60 MIN_w8=50
  MIN_stt=60 MIN_tts=60 MIN_profile=45 MIN_capacity_int8=90 MIN_capacity_paged=90
fi
CAPACITY_ARGS=${CAPACITY_ARGS:-$DEFAULT_CAPACITY}
PREFILL_ARGS=${PREFILL_ARGS:-$DEFAULT_PREFILL}
KV_ARGS=${KV_ARGS:-$DEFAULT_KV}
W8_ARGS=${W8_ARGS:-$DEFAULT_W8}
STT_ARGS=${STT_ARGS:-$DEFAULT_STT}
TTS_ARGS=${TTS_ARGS:-$DEFAULT_TTS}
PROFILE_ARGS=${PROFILE_ARGS:-$DEFAULT_PROFILE}
CAPACITY_INT8_ARGS=${CAPACITY_INT8_ARGS:-$DEFAULT_CAPACITY_INT8}
CAPACITY_PAGED_ARGS=${CAPACITY_PAGED_ARGS:-$DEFAULT_CAPACITY_PAGED}
# The stages in the order they run: the Moshi capacity, the kernels, where a step goes and the served load test (at
# the capacity found) first, then int8 KV, 8-bit weights, STT, TTS and the persona prefill. SUITE_STAGES picks some
# of them (a second call on a fresh machine runs the rest).
FIRST_CALL="capacity kernels profile serve kv w8 stt tts prefill"
# A second call on the same warm machine (`SUITE_STAGES="capacity_int8 capacity_paged"`): the int8 capacity sweep and
# the attention kernels' A/B, which the first call's budget does not hold beside the rest.
SECOND_CALL="capacity_int8 capacity_paged"
ORDER="$FIRST_CALL $SECOND_CALL"
SUITE_STAGES=${SUITE_STAGES:-$FIRST_CALL}
for name in $SUITE_STAGES; do
  case " $ORDER " in *" $name "*) ;; *) echo "unknown stage '$name' in SUITE_STAGES (stages: $ORDER)" >&2; exit 2 ;; esac
done
FIRST_FAILURE=0

# Every process a stage started ends with the suite, however the suite ends. Stages run in the background and are
# waited for, so a signal is handled at once (bash holds a trap until a foreground command returns). The whole tree
# below the suite is stopped, children before their parent: a stage run as a function in the background (install)
# is a subshell whose commands would outlive it.
stop_tree() {
  local child
  for child in $(pgrep -P "$1"); do stop_tree "$child"; done
  kill -TERM "$1" 2> /dev/null
}
cleanup() {
  local child
  trap - INT TERM
  for child in $(pgrep -P $$); do stop_tree "$child"; done
  wait 2> /dev/null
}
trap 'cleanup; exit 130' INT
trap 'cleanup; exit 143' TERM
trap cleanup EXIT

say() { echo "[gpu_suite $(($(date +%s) - STARTED))s] $*"; }

# Seconds a stage may take: its own limit, within what is left of the budget after `reserve` seconds for later.
allow() {
  local limit=$1 reserve=$2 left
  left=$((BUDGET - ($(date +%s) - STARTED) - reserve))
  [ "$left" -lt "$limit" ] && limit=$left
  [ "$limit" -lt 5 ] && limit=5
  echo "$limit"
}

# Whether a stage is among SUITE_STAGES (default: all of ORDER).
wanted() { case " $SUITE_STAGES " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

# Seconds kept back for the wanted stages after NAME: each one's smallest useful share (MIN_*).
reserve() {
  local name after=0 total=0 min
  for name in install $ORDER; do
    if [ "$after" = 1 ] && wanted "$name"; then
      min="MIN_$name"
      total=$((total + ${!min}))
    fi
    [ "$name" = "$1" ] && after=1
  done
  echo "$total"
}

# stage NAME LIMIT_S CMD...: run CMD under `timeout` with its output in NAME.log; record rc and seconds.
stage() {
  local name=$1 limit=$2 t0 rc
  shift 2
  t0=$(date +%s)
  say "$name: start (limit ${limit}s)"
  timeout -k 10 "$limit" "$@" > "$DIR/$name.log" 2>&1 &
  wait $!
  rc=$?
  record "$name" "$rc" "$(($(date +%s) - t0))"
  return "$rc"
}

record() {
  local what="ok"
  [ "$2" -eq 124 ] || [ "$2" -eq 137 ] && what="timed out"
  [ "$2" -ne 0 ] && [ "$what" = ok ] && what="failed"
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$what" >> "$STAGES"
  say "$1: $what (rc $2, $3 s)"
  [ "$2" -ne 0 ] && [ "$FIRST_FAILURE" -eq 0 ] && FIRST_FAILURE=$2
  return 0
}

# Wheels into the scratch dir, duplexd itself (editable: its packages map onto the repo's folders), an import check.
install() {
  local limit=$1
  if compgen -G "$WHEELS/*.whl" > /dev/null; then
    timeout "$limit" "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" "$WHEELS"/*.whl \
      || return 1
  else
    echo "no wheels in $WHEELS: relying on the image for duplexd's dependencies"
  fi
  if [ "$DRY" = 1 ]; then
    echo "dry run: duplexd as the caller's Python has it (not reinstalled)"
  else
    timeout "$limit" "$PYTHON" -m pip install -q --no-index --no-build-isolation --no-deps -e . || return 1
  fi
  # One interpreter for both checks (importing torch is seconds of CPU), outside the repo so that duplexd comes
  # from where it is installed.
  (cd / && timeout "$limit" "$PYTHON" -c "import duplexd.server.app, duplexd.commands.cli; print('duplexd imports')
import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(),
  torch.cuda.get_device_name() if torch.cuda.is_available() else '')") || return 1
  "$PYTHON" -m pip list 2>/dev/null | grep -iE "^(torch|triton|numpy|fastapi|uvicorn|websockets|pydantic) " || true
}

# The capacity the sweep found, then in words what that number is: when the sweep failed or did not finish, the
# largest batch that met the budget (not a capacity); nothing when there is nothing to serve at.
capacity() {
  "$PYTHON" - "$DIR/gpu_capacity.json" <<'EOF'
import json, sys
try:
    report = json.load(open(sys.argv[1]))
except (OSError, ValueError):
    sys.exit(0)
status = report.get("status")
if status == "ok" and report.get("realtime_sessions"):
    print(report["realtime_sessions"], "the capacity found")
elif status != "ok":
    ok = [b["batch"] for b in report.get("batches", []) if b.get("meets_budget")]
    if ok:
        why = "a later batch FAILED" if status == "failed" else "the sweep did not finish"
        print(max(ok), f"the largest batch within budget, NOT a capacity: {why}")
EOF
}

serve_and_load() {
  local n=$1 port server rc ready
  port=$("$PYTHON" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
  # shellcheck disable=SC2086
  ready=$(allow "$T_READY" $((LOAD_SECONDS + 30 + $(reserve serve))))
  timeout -k 10 "$((ready + LOAD_SECONDS + 90))" "$PYTHON" -m duplexd serve --random-weights "$PRESET" \
    --device "$DEVICE" --max-sessions "$n" --port "$port" --static none --idle-timeout 30 \
    > "$DIR/serve.log" 2>&1 &
  server=$!
  say "serve: pid $server on port $port, $n sessions; waiting for /ready"
  # In the background and waited for, as a stage is: a signal stops the suite at once, not after the wait.
  "$PYTHON" - "$port" "$ready" "$server" <<'EOF' &
import json, os, sys, time, urllib.request
port, limit, pid = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
deadline = time.monotonic() + limit
while time.monotonic() < deadline:
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit("the server exited before it was ready (serve.log)")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=5) as r:
            print(json.dumps(json.load(r)))
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as m:
                print(json.dumps(json.load(m)))
            sys.exit(0)
    except OSError:
        time.sleep(0.5)
sys.exit(f"not ready within {limit:g} s (serve.log)")
EOF
  if ! wait $!; then
    kill -TERM "$server" 2>/dev/null; wait "$server" 2>/dev/null
    return 1
  fi
  say "serve: ready; loadtest: $n sessions, realtime, ${LOAD_SECONDS}s"
  # shellcheck disable=SC2086
  stage loadtest "$(allow $((LOAD_SECONDS + 60)) "$(reserve serve)")" "$PYTHON" -m duplexd loadtest \
    --url "ws://127.0.0.1:$port" --protocol realtime --sessions "$n" --duration "$LOAD_SECONDS" --quiet \
    --json "$DIR/loadtest.json" --plot "$DIR/loadtest.png" $LOAD_CHECKS
  rc=$?
  "$PYTHON" -c "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(
    'http://127.0.0.1:$port/metrics', timeout=5).read().decode())" > "$DIR/metrics.txt" 2>&1
  kill -TERM "$server" 2>/dev/null
  wait "$server" 2>/dev/null
  return $rc
}

say "out: $DIR; python: $PYTHON; dry run: $DRY; budget ${BUDGET}s"
{ echo "commit: $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)"; date -u; uname -a
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "no nvidia-smi"
} > "$DIR/machine.txt"

t0=$(date +%s)
say "install: start"
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"  # the wheels install puts there, for every later stage
install "$(allow "$T_INSTALL" "$(reserve install)")" > "$DIR/install.log" 2>&1 &
wait $!
record install $? "$(($(date +%s) - t0))"
if [ -n "$TRITON_CACHE" ]; then
  "$PYTHON" bench/gpu_triton_cache.py --check > "$DIR/triton_cache.log" 2>&1
  grep -E '^(Triton cache|key|kernel sources)' "$DIR/triton_cache.log"
fi

if wanted capacity; then
  # shellcheck disable=SC2086
  stage gpu_capacity "$(allow "$T_CAPACITY" "$(reserve capacity)")" \
    "$PYTHON" bench/gpu_capacity.py $CAPACITY_ARGS --out "$DIR"
  grep -E '^(batch |capacity|FAILED|note|models)' "$DIR/gpu_capacity.log" | tail -n 25
fi

if wanted kernels; then
  stage gpu_kernels "$(allow "$T_KERNELS" "$(reserve kernels)")" "$PYTHON" bench/gpu_kernels.py
  tail -n 80 "$DIR/gpu_kernels.log" | grep -v "^{" | tail -n 70
fi

if wanted profile; then
  # shellcheck disable=SC2086
  stage gpu_profile "$(allow "$T_PROFILE" "$(reserve profile)")" "$PYTHON" bench/gpu_profile.py $PROFILE_ARGS --out "$DIR"
  grep -E '^(\||batch |no CUDA)' "$DIR/gpu_profile.log" | tail -n 50
fi

if wanted serve; then
  if [ -n "${SERVE_SESSIONS:-}" ]; then
    SESSIONS=$SERVE_SESSIONS BASIS="SERVE_SESSIONS, given"
  else
    read -r SESSIONS BASIS <<< "$(capacity)"
  fi
  if [ -n "${SESSIONS:-}" ]; then
    echo "serving at $SESSIONS sessions ($BASIS)" > "$DIR/serve_basis.txt"
    t0=$(date +%s)
    serve_and_load "$SESSIONS"
    rc=$?
    record serve "$rc" "$(($(date +%s) - t0))"
  else
    echo "no capacity to serve at (see gpu_capacity.log)" > "$DIR/serve_basis.txt"
    record serve 3 0
  fi
fi

if wanted kv; then
  # shellcheck disable=SC2086
  stage kv_dtype "$(allow "$T_KV" "$(reserve kv)")" "$PYTHON" bench/kv_dtype.py $KV_ARGS --out "$DIR"
  grep -E '^(capacity|write|agreement|steps|no CUDA)' "$DIR/kv_dtype.log" | tail -n 12
fi

if wanted w8; then
  # shellcheck disable=SC2086
  stage weights_dtype "$(allow "$T_W8" "$(reserve w8)")" "$PYTHON" bench/weights_dtype.py $W8_ARGS --out "$DIR"
  grep -E '^(capacity|kernel|steps|agreement|no CUDA)' "$DIR/weights_dtype.log" | tail -n 60
fi

if wanted stt; then
  mkdir -p "$DIR/stt"
  # shellcheck disable=SC2086
  stage stt_capacity "$(allow "$T_STT" "$(reserve stt)")" "$PYTHON" bench/gpu_capacity.py $STT_ARGS --out "$DIR/stt"
  grep -E '^(batch |capacity|FAILED|note)' "$DIR/stt_capacity.log" | tail -n 20
fi

if wanted tts; then
  # shellcheck disable=SC2086
  stage gpu_tts "$(allow "$T_TTS" "$(reserve tts)")" "$PYTHON" bench/gpu_tts.py $TTS_ARGS --out "$DIR"
  grep -E '^(batch |tts|demo)' "$DIR/gpu_tts.log" | tail -n 8
fi

if wanted prefill; then
  # shellcheck disable=SC2086
  stage prompt_prefill "$(allow "$T_PREFILL" "$(reserve prefill)")" "$PYTHON" bench/prompt_prefill.py $PREFILL_ARGS
  grep -E '^(\||persona|batch 1|[0-9]+ live|no CUDA)' "$DIR/prompt_prefill.log" | tail -n 12
fi

if wanted capacity_int8; then
  mkdir -p "$DIR/int8"
  # shellcheck disable=SC2086
  stage capacity_int8 "$(allow "$T_CAPACITY_INT8" "$(reserve capacity_int8)")" \
    "$PYTHON" bench/gpu_capacity.py $CAPACITY_INT8_ARGS --out "$DIR/int8"
  grep -E '^(batch |capacity|FAILED|note|models)' "$DIR/capacity_int8.log" | tail -n 25
fi

if wanted capacity_paged; then
  mkdir -p "$DIR/paged"
  # shellcheck disable=SC2086
  stage capacity_paged "$(allow "$T_CAPACITY_PAGED" "$(reserve capacity_paged)")" \
    "$PYTHON" bench/gpu_capacity.py $CAPACITY_PAGED_ARGS --out "$DIR/paged"
  grep -E '^(batch |capacity|FAILED|note|models)' "$DIR/capacity_paged.log" | tail -n 25
fi

if [ -n "$TRITON_CACHE" ]; then
  "$PYTHON" bench/gpu_triton_cache.py --report >> "$DIR/triton_cache.log" 2>&1
  grep '^Triton cache:' "$DIR/triton_cache.log" | tail -n 1
fi
"$PYTHON" bench/gpu_summary.py "$DIR" > "$DIR/summary.log" 2>&1 || record summary $? 0
say "done in $(($(date +%s) - STARTED)) s; everything is in $DIR"
cat "$DIR/summary.log"
exit "$FIRST_FAILURE"
