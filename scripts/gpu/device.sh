#!/usr/bin/env bash
# Device side of scripts/gpu/stage.sh (runs on the GPU machine, from the copy of the repository that
# travels with each call):
#   device.sh stage UNIT...   copy carried units (.gpu-stage/UNIT) into /tmp/stage
#   device.sh install         join the wheels staged in parts, check every wheel against .gpu-stage's
#                             WHEELS (name, SHA-256), install them under /tmp/site and each speculators
#                             release under /tmp/spec-X
set -euo pipefail
cd "$(dirname "$0")/../.."
case "${1:-}" in
  stage)
    shift; mkdir -p /tmp/stage
    for u in "$@"; do cp -r ".gpu-stage/$u/." /tmp/stage/; echo "staged $u"; done ;;
  install)
    cd /tmp/stage
    [ -s WHEELS ] || { echo "no WHEELS list in /tmp/stage: unit0 was not staged"; exit 3; }
    while read -r name sha; do
      if [ ! -f "$name" ]; then
        ls "$name".part* > /dev/null 2>&1 || { echo "$name: not staged (no file, no parts)"; exit 3; }
        cat "$name".part* > "$name" && rm -f "$name".part*
      fi
      got=$(sha256sum "$name" | cut -c1-64)
      [ "$got" = "$sha" ] || { echo "$name: hash mismatch, a unit is missing ($got != $sha)"; exit 3; }
    done < WHEELS
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      $(ls ./*.whl | grep -v '/speculators-')
    for w in ./speculators-*.whl; do
      s=$(basename "$w" | cut -d- -f2)
      python3 -m pip install -q --no-index --no-deps --no-compile --target "/tmp/spec-$s" "$w"
    done
    echo "installed: $(cut -d' ' -f1 WHEELS | tr '\n' ' ')" ;;
  *) echo "usage: device.sh stage UNIT... | install"; exit 2 ;;
esac
