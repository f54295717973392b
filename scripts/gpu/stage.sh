#!/usr/bin/env bash
# Prepare a CUDA vLLM release + speculators for an offline GPU machine (no network there, 64 MiB per
# call). Run here:   scripts/gpu/stage.sh 0.24.0
# then, back to back on the device (see docs/gpu.md): one `stage unitK` call per unit, then
# `scripts/gpu/device_run.sh install` and the test/bench modes.
set -euo pipefail
cd "$(dirname "$0")/../.."
V="${1:-0.24.0}"
grep -qxF "/.gpu-stage/" .git/info/exclude 2>/dev/null || echo "/.gpu-stage/" >> .git/info/exclude
# vLLM's wheel and the runtime deps the device image lacks (shared tool), plus what
# `import speculators` needs that vLLM does not bring.
../shared/tools/gpu-stage/prepare.sh "$V" .gpu-stage loguru pydantic-settings python-dotenv
# speculators versions go to their own unit: each is installed into its own folder on the device.
rm -rf .gpu-stage/spec && mkdir -p .gpu-stage/spec
for s in 0.3.0 0.4.0.1; do
  pip download -q --no-deps -d .gpu-stage/spec "speculators==$s"
done
du -sh .gpu-stage/unit* .gpu-stage/spec
ls .gpu-stage
