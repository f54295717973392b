#!/usr/bin/env bash
# Prepare a CUDA vLLM release + speculators for an offline GPU machine (no network there, 64 MiB per
# call). Run here:   scripts/gpu/stage.sh 0.32.0
# then, back to back on the device (see docs/gpu.md): one `stage unitK ...` call per line of
# .gpu-stage/CALLS (the units that fit in one call), then `scripts/gpu/device_run.sh install` and the test/bench modes.
#
# The device image has Python 3.12 and torch 2.11.0+cu130 (transformers 5.17.0, cuDNN 9.19). vLLM
# 0.20.0-0.26.0 pin torch 2.11.0 and need only the vLLM wheel and the deps the image lacks. Later
# releases pin a newer torch (0.27.0-0.32.0: 2.13.0, 0.33.0: 2.14.0); for those this also stages,
# as wheels split into parts of <= 56 MiB, the torch wheel and what that torch needs at versions
# the image does not have: triton, NCCL, cuDNN (vision towers run convolutions through it),
# torchvision built for it (vLLM's GPU warm-up imports it), and transformers when vLLM's
# requirement excludes the image's. Each is read from the wheels' metadata, nothing is guessed.
#   STAGE_CUDNN=0   leave cuDNN out (text-only models never call it; saves ~13 units)
set -euo pipefail
cd "$(dirname "$0")/../.."
V="${1:-0.24.0}"
DEST=.gpu-stage
IMAGE_TORCH=2.11.0
IMAGE_TRANSFORMERS=5.17.0
IMAGE_CUDNN=9.19
PART=56m
# .gpu-stage/ is in .gitignore: it never travels with the checkout, only as a carried unit.
git check-ignore -q "$DEST/" || { echo "$DEST/ must be ignored by git (see .gitignore)"; exit 2; }
# vLLM's wheel and the runtime deps the device image lacks (shared tool), plus what
# `import speculators` needs that vLLM does not bring.
../shared/tools/gpu-stage/prepare.sh "$V" "$DEST" loguru pydantic-settings python-dotenv
# torchcodec and pynvvideocodec (video decoding) are built for vLLM's torch and are not needed for
# text and image prompts: leave them out (a unit saved, no mismatched extension on the device).
rm -f "$DEST"/unit*/torchcodec-*.whl "$DEST"/unit*/pynvvideocodec-*.whl
find "$DEST" -maxdepth 1 -name 'unit*' -type d -empty -delete
# speculators versions go to their own unit: each is installed into its own folder on the device.
rm -rf "$DEST/spec" "$DEST/big" && mkdir -p "$DEST/spec"
for s in 0.3.0 0.4.0.1; do
  pip download -q --no-deps -d "$DEST/spec" "speculators==$s"
done

plat() {  # pip platform flags for CPython 3.12 on x86_64, manylinux tags from $1 down
  local out=(--only-binary=:all: --python-version 3.12 --implementation cp) seen=0
  for p in manylinux_2_39 manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 \
           manylinux_2_24 manylinux_2_18 manylinux_2_17 manylinux2014; do
    [[ $p == "$1" ]] && seen=1
    (( seen )) && out+=(--platform "${p}_x86_64")
  done
  echo "${out[@]}"
}
meta() { unzip -p "$1" '*.dist-info/METADATA' | sed -n 's/^Requires-Dist: //p' | grep -v 'extra ==' || true; }
pin() { meta "$1" | sed -n "s/^$2 *(\?==\([^ ;,)]*\).*/\1/p" | head -1; }  # exact pin of $2 in wheel $1 ("x==1" or "x (==1)")
spec() { meta "$1" | sed -n "s/^$2 *(\?\([<>=!~][^;)]*\).*/\1/p" | head -1 | tr -d ' '; }  # "==3.7.1", "~=3.8.0"

vllm_whl=$(head -1 "$DEST/MANIFEST" | cut -d' ' -f3)
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
pip download -q --no-deps -d "$work/v" $(plat manylinux_2_39) "vllm==$V"
vw="$work/v/$vllm_whl"
torch_pin=$(pin "$vw" torch)
big=()  # wheels to stage in parts
if [[ -n $torch_pin && $torch_pin != "$IMAGE_TORCH" ]]; then
  pip download -q --no-deps -d "$work/b" $(plat manylinux_2_28) "torch==$torch_pin"
  tw=$(ls "$work"/b/torch-*.whl)
  # torch 2.13 pins triton==3.7.1, torch 2.14 triton~=3.8.0: take the requirement as written
  triton=$(spec "$tw" triton); nccl=$(spec "$tw" nvidia-nccl-cu13); cudnn=$(pin "$tw" nvidia-cudnn-cu13)
  [[ -n $triton ]] || { echo "torch $torch_pin: no triton requirement found in its metadata"; exit 3; }
  pip download -q --no-deps -d "$work/b" $(plat manylinux_2_28) "triton$triton"
  # NCCL's wheel is tagged manylinux_2_18: ask pip for that platform explicitly.
  [[ -n $nccl ]] && pip download -q --no-deps -d "$work/b" $(plat manylinux_2_18) "nvidia-nccl-cu13$nccl"
  if [[ -n $cudnn && ${cudnn%.*.*} != "$IMAGE_CUDNN" && ${STAGE_CUDNN:-1} != 0 ]]; then
    pip download -q --no-deps -d "$work/b" $(plat manylinux_2_27) "nvidia-cudnn-cu13==$cudnn"
  fi
  # torchvision built for this torch: release 0.(minor+15) pins torch 2.minor exactly (checked)
  t="0.$(( $(cut -d. -f2 <<< "$torch_pin") + 15 )).0"
  pip download -q --no-deps -d "$work/b" $(plat manylinux_2_28) "torchvision==$t"
  [[ $(pin "$(ls "$work"/b/torchvision-*.whl)" torch) == "$torch_pin" ]] || { echo "torchvision $t does not pin torch==$torch_pin"; exit 3; }
fi
# transformers: staged when vLLM's requirement excludes the image's version
treq=$(meta "$vw" | sed -n 's/^transformers\( *[<>=!~][^;]*\)\?.*/\1/p' | head -1 | tr -d ' ')
if [[ -n $treq ]] && ! python3 -c "import sys; from packaging.specifiers import SpecifierSet as S; sys.exit(0 if '$IMAGE_TRANSFORMERS' in S('$treq') else 1)"; then
  pip download -q --no-deps -d "$work/b" "transformers$treq"
fi

# Pack: each wheel over the unit size is split into parts, the rest fill units of <= 56 MiB.
u=$(( $(ls -d "$DEST"/unit* | sed 's/.*unit//' | sort -n | tail -1) + 1 ))
size=$((56*1024*1024)); fill=$size
: > "$DEST/BIG_MANIFEST"
for f in "$work"/b/*.whl; do
  [[ -f $f ]] || continue
  n=$(basename "$f")
  echo "$n $(sha256sum "$f" | cut -c1-64)" >> "$DEST/BIG_MANIFEST"
  if (( $(stat -c %s "$f") > size )); then
    split -b "$PART" -d -a 2 "$f" "$work/$n.part"
    for p in "$work/$n".part*; do mkdir -p "$DEST/unit$u"; mv "$p" "$DEST/unit$u/"; u=$((u+1)); done
  else
    s=$(stat -c %s "$f")
    if (( fill + s > size )); then mkdir -p "$DEST/unit$u"; cur=$u; u=$((u+1)); fill=0; fi
    mv "$f" "$DEST/unit$cur/$n.part00"; fill=$((fill + s))
  fi
done
# the big-wheel manifest travels in unit0 (carried first)
cp "$DEST/BIG_MANIFEST" "$DEST/unit0/BIG_MANIFEST"
ls -d "$DEST"/unit* | xargs -n1 basename | sort -V > "$DEST/UNITS"
echo "vLLM $V pins torch ${torch_pin:-?} (image: $IMAGE_TORCH); staged in parts:"; cut -d' ' -f1 "$DEST/BIG_MANIFEST"
# sizes of what each unit carries (files only); a call carries the checkout too, 64 MiB in all
checkout=$(git ls-files -z | xargs -0 stat -c %s | awk '{ s += $1 } END { print s }')
for d in $(sed "s|^|$DEST/|" "$DEST/UNITS") "$DEST/spec"; do
  printf '%s %s\n' "$(find "$d" -type f -printf '%s\n' | awk '{ s += $1 } END { print s }')" "$d"
done | awk -v c="$checkout" '{ printf "%-22s %6.2f MiB%s\n", $2, $1/1048576, ($1 + c > 64*1048576 ? "  OVER THE 64 MiB CALL LIMIT WITH THE CHECKOUT" : "") }'
echo "checkout: $(awk -v c="$checkout" 'BEGIN { printf "%.2f", c/1048576 }') MiB"
# Calls: units packed first-fit (largest first) into calls of <= 63 MiB with the checkout, at most 7
# units a call (carry takes 8 paths; device.sh is one): one line of .gpu-stage/CALLS per call.
for u in $(cat "$DEST/UNITS"); do echo "$(find "$DEST/$u" -type f -printf '%s\n' | awk '{ s += $1 } END { print s }') $u"; done \
  | sort -rn | awk -v room=$(( 63*1048576 - checkout )) '
      { for (i = 1; i <= n; i++) if (used[i] + $1 <= room && count[i] < 7) break
        if (i > n) { n = i; used[i] = 0; count[i] = 0 }
        used[i] += $1; count[i]++; calls[i] = calls[i] " " $2 }
      END { for (i = 1; i <= n; i++) print substr(calls[i], 2) }' > "$DEST/CALLS"
echo "units: $(wc -l < "$DEST/UNITS") in $(wc -l < "$DEST/CALLS") back-to-back calls (.gpu-stage/CALLS: the units of each call)"
