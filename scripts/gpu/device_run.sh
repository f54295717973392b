#!/usr/bin/env bash
# Device side of the GPU evidence run (runs on the GPU machine, from a copy of the repository).
#   device_run.sh install            install the staged vLLM, speccompat and speculators under /tmp
#   device_run.sh test RUNNER [TP]   engine parity + silent-bug suites; RUNNER is v2 (default) or v1 (vLLM <= 0.33)
#   device_run.sh proof              a release's proof at TP=1 in one call (pytest --proof, tests/conftest.py):
#                                    parity, silent bugs, INT4, the serving-path and native-extraction oracles,
#                                    Qwen3, in $PROOF_SHARDS pytest processes side by side, each holding whole
#                                    the groups of tests that share an engine; one evidence file
#                                    (speccompat.testing.proof merge) with the proof's wall time
#   device_run.sh kimi RUNNER [TP]   Kimi-K2.5 parity: kimi_k25 (bf16) and kimi_k25 with INT4 experts,
#                                    the thresholds' planted-bug checks, and vLLM's parse of the INT4 config
#   device_run.sh reset              forget the staged and installed release, so that another one can be
#                                    staged and installed on the same machine (its stage calls come next)
#   device_run.sh bench              throughput of speculators+speccompat vs plain vLLM prefill
#   device_run.sh fp8-error          fp8 hidden states' error per layer and scale granularity (benchmarks/fp8_error.py):
#                                    the 8B shape at $CKPT (/dev/shm/ckpt-8b) and Kimi-K2.5's tiny checkpoint
#   device_run.sh smoke              one engine start on a tiny Llama (what every test needs first), with a
#                                    limit of $SMOKE_TIMEOUT s (240): a release whose engine cannot start fails
#                                    here in minutes, not in every test of the proof
#   device_run.sh ckpt8b             build the 8B-shaped checkpoint at $CKPT (/tmp/ckpt-8b) in the background
#                                    (it outlives the call; /tmp/ckpt-8b.done when finished)
# Results go to $OUT (evidence JSON, logs, benchmark JSON).
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=/tmp/site VLLM_WORKER_MULTIPROC_METHOD=spawn
if [ -d /tmp/nocudnn ]; then export PYTHONPATH=/tmp/nocudnn:/tmp/site SPECCOMPAT_NO_CUDNN=1; fi
# Python reads .pth files in site-packages only, not in a --target folder on PYTHONPATH: add the folders
# that the staged packages' .pth files put on sys.path, first, as the .pth files insert them (nvidia-cutlass-dsl's
# `cutlass` package is in one; the image has another `cutlass` that must not shadow it).
if compgen -G "/tmp/site/*.pth" > /dev/null; then
  PYTHONPATH="$(python3 -c 'import site, sys; before = set(sys.path); site.addsitedir("/tmp/site")
print(":".join(p for p in sys.path if p not in before and p != "/tmp/site"))'):$PYTHONPATH"
fi
export SPECCOMPAT_ENV_FILE=/tmp/speccompat-env.json
# FlashInfer's top-k/top-p sampler is JIT-compiled on a fresh machine's first engine start (minutes,
# no network to fetch its kernels); prefill runs greedy, and hidden states never pass the sampler.
export VLLM_USE_FLASHINFER_SAMPLER="${VLLM_USE_FLASHINFER_SAMPLER:-0}"
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
case "${1:-}" in
  install)
    bash scripts/gpu/device.sh install
    if grep -q '^torch-' /tmp/stage/WHEELS; then
      # The image's torchvision/torchaudio are built for its own torch and break transformers under
      # the staged one ("operator torchvision::nms does not exist"): move them out of its site-packages
      # (the machine is thrown away after the run); torchvision for the staged torch is installed instead.
      for m in torchvision torchaudio; do
        d=$(env -u PYTHONPATH python3 -c "import importlib.util as u, os; s = u.find_spec('$m'); print(os.path.dirname(s.origin) if s else '')")
        if [ -n "$d" ]; then mkdir -p /tmp/aside && mv "$d" /tmp/aside/ && echo "moved aside $d"; fi
      done
      # Without cuDNN staged, the image's cuDNN (9.19) is older than the one torch >= 2.13 was built
      # against: engines run with cuDNN off (it only serves a vision tower's patch convolution, which
      # text-only prompts reach in vLLM's profiling run alone). sitecustomize reads SPECCOMPAT_NO_CUDNN.
      if ! grep -q '^nvidia_cudnn' /tmp/stage/WHEELS; then
        mkdir -p /tmp/nocudnn
        printf 'import os\nif os.environ.get("SPECCOMPAT_NO_CUDNN") == "1":\n    import torch\n    torch.backends.cudnn.enabled = False\n' \
          > /tmp/nocudnn/sitecustomize.py
        echo "cuDNN not staged: engines run with torch.backends.cudnn.enabled = False"
      fi
    fi
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site . 2>&1 | tail -2
    V=$(python3 -c "import importlib.metadata as m; print(m.version('vllm'))")
    python3 -c "import json, sys, glob, os
spec = {os.path.basename(d)[len('spec-'):]: d for d in sorted(glob.glob('/tmp/spec-*'))}
json.dump({'vllm': sys.argv[1], 'vllm_dist': 'vllm', 'speculators': spec, 'python': sys.argv[2]}, open('/tmp/speccompat-env.json', 'w'))" \
      "$V" "$(command -v python3)"
    cat /tmp/speccompat-env.json; echo
    cat /tmp/stage/STAGED 2>/dev/null | tee "$OUT/gpu.txt"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$OUT/gpu.txt"
    python3 -c "import torch, vllm; print('torch', torch.__version__, 'vllm', vllm.__version__)" | tee -a "$OUT/gpu.txt"
    # The packages were installed without byte code (--no-compile): import what an engine start imports
    # once now, so that the proof's processes, which start side by side, do not each compile it; then
    # once more, to see what a start's imports cost with the byte code there.
    for pass in ${IMPORT_PASSES-compile warm}; do  # IMPORT_PASSES="": no timing
      PYTHONPATH="$PYTHONPATH:/tmp/spec-0.4.0.1" python3 -c "
import importlib, time
t = time.monotonic()
import speccompat; speccompat.apply()  # before speculators, as every user does
for m in ('torch', 'transformers', 'vllm', 'vllm.v1.executor.multiproc_executor', 'vllm.v1.worker.gpu_worker',
          'vllm.entrypoints.llm', 'vllm.model_executor.models.llama', 'vllm.model_executor.models.deepseek_v2',
          'vllm.model_executor.models.kimi_k25', 'vllm.model_executor.models.qwen3', 'speccompat.capture',
          'speculators.data_generation'):
    t0 = time.monotonic()
    try:
        importlib.import_module(m)
        print(f'  {m}: {time.monotonic() - t0:.1f} s')
    except Exception as exc:  # noqa: BLE001 - a measurement, not a check
        print(f'  {m}: {type(exc).__name__}: {exc}'[:200])
print('imports ($pass):', round(time.monotonic() - t, 1), 's')" 2>&1 | grep -v Warning | tee -a "$OUT/imports.txt"
    done
    ;;
  test)
    RUNNER="${2:-v2}"; TP="${3:-1}"
    V=$(python3 -c "import json; print(json.load(open('/tmp/speccompat-env.json'))['vllm'])")
    if [ "$RUNNER" = v1 ]; then
      # vLLM 0.34.0 removed the V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0 raises in EngineArgs)
      if python3 -c "import sys; from packaging.version import Version as W; sys.exit(W('$V') >= W('0.34.0'))"; then
        export VLLM_USE_V2_MODEL_RUNNER=0
      else
        echo "vLLM $V has no V1 model runner (removed in 0.34.0): run 'test v2'"; exit 2
      fi
    else
      unset VLLM_USE_V2_MODEL_RUNNER
    fi
    N="$RUNNER-tp$TP${OUT_NAME:+-$OUT_NAME}"
    export SPECCOMPAT_EVIDENCE_OUT="${EVIDENCE_OUT:-$OUT/vllm-$V-tp$TP-$RUNNER${OUT_NAME:+-$OUT_NAME}.json}" SPECCOMPAT_TEST_TP="$TP" SPECCOMPAT_TEST_RUNNER="$RUNNER"
    BT="/tmp/pytest-$N"
    set +e
    # At the limit pytest gets SIGINT, not SIGTERM, so that it still reports what ran, how long each
    # test took and where the one it was in stood; a test past FAULT_TIMEOUT s dumps every thread's stack.
    timeout -s INT -k 30 "${TEST_TIMEOUT:-540}" python3 -m pytest -q -p no:cacheprovider --basetemp="$BT" --durations=0 \
      -o faulthandler_timeout="${FAULT_TIMEOUT:-240}" ${PYTEST_ARGS:-} ${TEST_FILES:-tests/engine/test_parity.py \
      tests/engine/test_silent_bugs.py} -k "${TEST_SELECT-not control and not non_finite and not bad_ and not repeated and not overlong}" 2>&1 | tail -400 | tee "$OUT/pytest-$N.txt"
    rc=${PIPESTATUS[0]}
    for f in "$BT"/engines0/logs/*.log; do
      [ -f "$f" ] && { echo "=== $f"; tail -c 20000 "$f"; }
    done > "$OUT/logs-$N.txt" 2>/dev/null
    exit $rc
    ;;
  reset)
    # what stage and install made (the image's torchvision/torchaudio stay aside: the next install
    # brings the ones built for its torch)
    rm -rf /tmp/stage /tmp/site /tmp/spec-* /tmp/nocudnn /tmp/speccompat-env.json /tmp/pytest-*
    echo "reset: no release staged or installed"
    ;;
  proof)
    # A release's proof at TP=1 on the default runner in one call: the tests `pytest --proof` selects
    # (PROOF in tests/conftest.py), split into $PROOF_SHARDS shards that run side by side; each shard
    # holds whole every group of tests that share an engine, so no engine starts twice
    # (speccompat.testing.proof). An engine start is most of a test's time (60-117 s on vLLM 0.34.0; an
    # extraction under a second), so the shards' engines start in parallel; each test process keeps two
    # torch threads for its transformers references (SPECCOMPAT_TEST_TORCH_THREADS): three processes of
    # 16 threads each beside the engines' start-up oversubscribed the cores. vLLM's own engines (the oracles) get a fixed
    # 2 GiB KV cache (SPECCOMPAT_ORACLE_KV_CACHE_BYTES, speccompat.testing.serving): their memory profiling
    # fails when another shard's engine frees GPU memory meanwhile (vLLM 0.34.0, H100, 2026-12-08: 2 of 44). Evidence: $OUT/vllm-V-tp1-v2-proof.json and
    # architectures-vllm-V.json, with the proof's wall time, every test's seconds and every engine start.
    V=$(python3 -c "import json; print(json.load(open('/tmp/speccompat-env.json'))['vllm'])")
    N="${PROOF_SHARDS:-8}"; T="${TEST_TIMEOUT:-520}"; S="$OUT/proof-shards"; mkdir -p "$S"
    # the files of PROOF (tests/conftest.py) and those holding the capture's CUDA paths (marker gpu)
    PROOF_FILES="tests/engine/test_parity.py tests/engine/test_silent_bugs.py tests/engine/test_int4.py
      tests/engine/test_serving_path.py tests/engine/test_native_extract.py tests/engine/test_architectures.py
      tests/test_capture.py tests/test_transport.py tests/test_stream.py"
    t0=$(date +%s.%N); pids=()
    for k in $(seq 1 "$N"); do
      TEST_TIMEOUT=$T OUT_NAME="proof-$k" TEST_FILES="$PROOF_FILES" TEST_SELECT="${PROOF_SELECT:-}" PYTEST_ARGS="--proof --shard $k/$N" \
        EVIDENCE_OUT="$S/evidence-$k.json" SPECCOMPAT_ARCH_EVIDENCE_OUT="$S/architectures-$k.json" \
        SPECCOMPAT_TEST_TIMES_OUT="$S/times-$k.json" SPECCOMPAT_ENGINE_STARTS_OUT="$S/starts-$k.json" \
        SPECCOMPAT_POOL_MAX_ALIVE=1 SPECCOMPAT_TEST_TORCH_THREADS=2 SPECCOMPAT_ORACLE_KV_CACHE_BYTES=$((2 << 30)) \
        bash "$0" test v2 1 > /dev/null 2>&1 &
      pids+=($!)
    done
    rc=0; for p in "${pids[@]}"; do wait "$p" || rc=$?; done
    wall=$(python3 -c "import time; print(round(time.time() - $t0, 1))")
    python3 -m speccompat.testing.proof merge "$S" --out "$OUT" --wall "$wall" || rc=$?
    for k in $(seq 1 "$N"); do tail -n 3 "$OUT/pytest-v2-tp1-proof-$k.txt"; done
    # one file for the shards' files, pytest's reports and the engines' logs: few files come back
    (cd "$OUT" && tar czf proof-files.tgz --remove-files proof-shards pytest-*.txt logs-*.txt)
    echo "proof: $N shards, ${wall} s"
    exit $rc
    ;;
  smoke)
    timeout "${SMOKE_TIMEOUT:-240}" python3 -c "
import time
t0 = time.monotonic()
from cutlass import Float8E4M3FN  # CuTe DSL, which vLLM's kernel warm-up imports on every CUDA start
from speccompat.testing.models import make_checkpoint
from vllm import LLM, SamplingParams
make_checkpoint('llama', '/tmp/smoke-llama')
llm = LLM(model='/tmp/smoke-llama', enforce_eager=True, gpu_memory_utilization=0.1, max_model_len=256)
out = llm.generate([{'prompt_token_ids': [5, 6, 7, 8]}], SamplingParams(max_tokens=4, temperature=0))
print('engine up and generating in', round(time.monotonic() - t0, 1), 's:', list(out[0].outputs[0].token_ids))
" 2>&1 | tail -25 | tee "$OUT/smoke.txt"
    exit "${PIPESTATUS[0]}"
    ;;
  kimi)
    RUNNER="${2:-v2}"; TP="${3:-1}"
    TEST_FILES="tests/engine/test_parity.py tests/engine/test_int4.py" \
      TEST_SELECT="${TEST_SELECT:-kimi_k25 or int4 or planted}" OUT_NAME=kimi \
      exec bash "$0" test "$RUNNER" "$TP"
    ;;
  ckpt8b)
    setsid nohup python3 -c "
from speccompat.testing.models import make_checkpoint
make_checkpoint('llama', '${CKPT:-/tmp/ckpt-8b}', device='cuda', hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8)
open('/tmp/ckpt-8b.done', 'w').close()" > /tmp/ckpt-8b.log 2>&1 < /dev/null &
    echo "building ${CKPT:-/tmp/ckpt-8b} in the background (log /tmp/ckpt-8b.log)"
    ;;
  bench)
    if [ -n "${WAIT_CKPT:-}" ]; then
      while [ ! -f /tmp/ckpt-8b.done ]; do sleep 2; done; tail -2 /tmp/ckpt-8b.log
    fi
    PYTHONPATH="$PYTHONPATH:/tmp/spec-0.4.0.1" python3 benchmarks/throughput.py --out "$OUT/bench-gpu${BENCH_NAME:+-$BENCH_NAME}.json" ${BENCH_ARGS:-}
    ;;
  fp8-error)
    PYTHONPATH="$PYTHONPATH:/tmp/spec-0.4.0.1" python3 benchmarks/fp8_error.py --config 8b \
      --model-path "${CKPT:-/dev/shm/ckpt-8b}" --out "$OUT/fp8-error-gpu-8b.json"
    PYTHONPATH="$PYTHONPATH:/tmp/spec-0.4.0.1" python3 benchmarks/fp8_error.py --model kimi_k25 \
      --out "$OUT/fp8-error-gpu-kimi_k25.json"
    ;;
  *) echo "usage: device_run.sh install | smoke | test [v1|v2] [TP] | proof | kimi [v1|v2] [TP] | reset | ckpt8b | bench | fp8-error"; exit 2 ;;
esac
