#!/usr/bin/env bash
# Prepare a CUDA vLLM release + speculators for an offline GPU machine (no network there, at most
# 64 MiB per call). Run here, from a checkout or a plain copy of the repository (git is not needed):
#   scripts/gpu/stage.sh 0.34.0
# then, back to back on the device (docs/gpu.md): one `bash scripts/gpu/device.sh stage UNIT...`
# call per line of .gpu-stage/CALLS, carrying those units, then `scripts/gpu/device_run.sh install`.
#
# The device image has Python 3.12, torch 2.11.0+cu130, transformers 5.17.0 and cuDNN 9.19
# (scripts/gpu/image-packages.txt lists its packages). Staged, read from the wheels' own metadata:
# the vLLM wheel and the runtime requirements the image lacks; flashinfer-python at vLLM's pin (or,
# where the index lacks that release, the next patch release of the same minor, said aloud); when
# vLLM pins another torch than the image's, that torch and what it needs at versions the image lacks
# (triton, NCCL, cuDNN, torchvision built for it) and transformers where vLLM excludes the image's;
# the speculators wheels 0.3.0, 0.4.0 and 0.4.0.1.
#
# Every wheel larger than a unit travels in parts; .gpu-stage/WHEELS names each wheel and its
# SHA-256, and device.sh joins and checks them. A unit holds at most what fits one call beside the
# checkout that travels with it (measured here), so that no call goes over 64 MiB.
#   STAGE_CUDNN=0         leave cuDNN out (text-only models never call it; saves ~13 units)
#   STAGE_FLASHINFER=X    stage flashinfer-python X instead of vLLM's pin
set -euo pipefail
cd "$(dirname "$0")/../.."
V="${1:?usage: scripts/gpu/stage.sh VLLM_VERSION}"
DEST=.gpu-stage
IMAGE_PACKAGES=scripts/gpu/image-packages.txt
IMAGE_TORCH=2.11.0
IMAGE_TRANSFORMERS=5.17.0
IMAGE_CUDNN=9.19
SPECULATORS=(0.3.0 0.4.0 0.4.0.1)
MIB=1048576
CALL_LIMIT=$((63 * MIB))  # what one call may carry, with a MiB to spare under the 64 MiB limit

# What travels with every call: the tracked and untracked-but-not-ignored files (git), or, in a copy
# without git metadata, every file outside the folders that .gitignore keeps out.
checkout_bytes() {
  if git rev-parse --is-inside-work-tree > /dev/null 2>&1; then
    { git ls-files -z; git ls-files -z --others --exclude-standard; } | xargs -0 -r stat -c %s 2> /dev/null
  else
    find . \( -name .git -o -name .envs -o -name '.gpu-stage*' -o -name .cache -o -name .nox -o -name __pycache__ \
      -o -name '*.egg-info' -o -path ./build -o -path ./dist -o -name .pytest_cache \) -prune -o -type f -printf '%s\n'
  fi | awk '{ s += $1 } END { print s + 0 }'
}
if git rev-parse --is-inside-work-tree > /dev/null 2>&1; then
  git check-ignore -q "$DEST/" || { echo "$DEST/ must be ignored by git (see .gitignore)"; exit 2; }
fi
checkout=$(checkout_bytes)
UNIT=$(( CALL_LIMIT - checkout ))
(( UNIT > 8 * MIB )) || { echo "the checkout ($((checkout / MIB)) MiB) leaves no room for a unit in a 64 MiB call"; exit 2; }
(( UNIT > 56 * MIB )) && UNIT=$((56 * MIB))

plat() {  # pip platform flags for CPython 3.12 on x86_64, manylinux tags from $1 down
  local out=(--only-binary=:all: --python-version 3.12 --implementation cp) seen=0
  for p in manylinux_2_39 manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 \
           manylinux_2_24 manylinux_2_18 manylinux_2_17 manylinux2014 manylinux1; do
    [[ $p == "$1" ]] && seen=1
    (( seen )) && out+=(--platform "${p}_x86_64")
  done
  echo "${out[@]}"
}
meta() { unzip -p "$1" '*.dist-info/METADATA' | sed -n 's/^Requires-Dist: //p' | grep -v 'extra ==' || true; }
pin() { meta "$1" | sed -n "s/^$2 *(\?==\([^ ;,)]*\).*/\1/p" | head -1; }  # exact pin of $2 in wheel $1
spec() { meta "$1" | sed -n "s/^$2 *(\?\([<>=!~][^;)]*\).*/\1/p" | head -1 | tr -d ' '; }  # "==3.7.1", "~=3.8.0"
name_of() { basename "$1" | cut -d- -f1 | tr 'A-Z_.' 'a-z--'; }
in_image() { grep -qxiF "$1" "$IMAGE_PACKAGES"; }

work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
mkdir -p "$work/w"
pip download -q --no-deps -d "$work/v" $(plat manylinux_2_39) "vllm==$V"
vw=$(ls "$work"/v/vllm-*.whl)
cp "$vw" "$work/w/"

# vLLM's runtime requirements the image lacks (video decoding left out: text and image prompts only)
meta "$vw" | grep -viE "^($(paste -sd'|' "$IMAGE_PACKAGES")|torchcodec|pynvvideocodec)([ <>=!~;\[(]|$)" > "$work/req.txt" || true
pip download -q -d "$work/deps" $(plat manylinux_2_39) -r "$work/req.txt"
pip download -q --no-deps -d "$work/deps" $(plat manylinux_2_39) loguru pydantic-settings python-dotenv
for f in "$work"/deps/*.whl; do  # transitive wheels the image already has (torch, nvidia-*, numpy, ...)
  n=$(name_of "$f")
  if in_image "$n" || [[ $n == nvidia-* || $n == torchcodec || $n == pynvvideocodec ]]; then rm -f "$f"; else mv "$f" "$work/w/"; fi
done
# Exact pins of packages the image has at some version of its own (vLLM 0.34.0: nvidia-cutlass-dsl[cu13]
# ==4.8.0, whose `cutlass` every CUDA worker imports in its kernel warm-up): staged at the pin, with the
# parts its extras name. torch and its family are staged below; flashinfer-python after this.
unzip -p "$vw" '*.dist-info/METADATA' | python3 -c '
import sys
from packaging.requirements import Requirement
env = {"python_version": "3.12", "python_full_version": "3.12.3", "platform_machine": "x86_64",
       "sys_platform": "linux", "platform_system": "Linux", "os_name": "posix", "implementation_name": "cpython",
       "platform_python_implementation": "CPython", "extra": ""}
image = {line.strip().lower() for line in open(sys.argv[1]) if line.strip()}
skip = {"torch", "torchvision", "torchaudio", "triton", "flashinfer-python"}
for line in sys.stdin:
    if not line.startswith("Requires-Dist: "):
        continue
    req = Requirement(line[len("Requires-Dist: "):].strip())
    name = req.name.lower().replace("_", "-").replace(".", "-")
    pins = [sp for sp in req.specifier if sp.operator == "=="]
    if (req.marker and not req.marker.evaluate(env)) or len(pins) != 1 or name in skip or name not in image:
        continue
    extras = "[" + ",".join(sorted(req.extras)) + "]" if req.extras else ""
    print(f"{req.name}{extras}=={pins[0].version}")
' "$IMAGE_PACKAGES" > "$work/pins.txt"
[[ -s $work/pins.txt ]] && pip download -q -d "$work/pins" $(plat manylinux_2_39) -r "$work/pins.txt"
for f in "$work"/pins/*.whl; do  # the pinned package and what it pins itself, never torch or CUDA runtime
  [[ -f $f ]] || continue
  n=$(name_of "$f")
  case "$n" in torch|triton|nvidia-cuda-*|nvidia-cublas*|nvidia-nccl*|nvidia-cudnn-cu*|nvidia-cusparse*|nvidia-cufft*|nvidia-curand*|nvidia-cusolver*|nvidia-nvjitlink*|nvidia-nvtx*|nvidia-cufile*|nvidia-nvshmem*) ;;
    *) cp -n "$f" "$work/w/" ;; esac
done

# flashinfer-python (pure Python, JIT; imported by the sampler): vLLM's pin where the index has it
fi_pin=$(pin "$vw" flashinfer-python)
fi_ver=${STAGE_FLASHINFER:-$fi_pin}
if [[ -n $fi_ver ]] && ! pip download -q --no-deps -d "$work/w" $(plat manylinux_2_39) "flashinfer-python==$fi_ver" 2> /dev/null; then
  [[ -z ${STAGE_FLASHINFER:-} ]] || { echo "flashinfer-python $fi_ver is not on the index"; exit 3; }
  # The index lacks the pinned release: take the next patch release of the same minor.
  series=${fi_pin%.*}
  fi_ver=$(pip index versions flashinfer-python 2> /dev/null | sed -n 's/^Available versions: //p' | tr -d ' ' | tr ',' '\n' \
    | python3 -c "import sys; from packaging.version import Version as V
pin, series = V('$fi_pin'), '$series'
ok = sorted(V(v) for v in sys.stdin.read().split() if v.startswith(series + '.') and V(v) > pin and not V(v).is_prerelease)
print(ok[0] if ok else '')")
  [[ -n $fi_ver ]] || { echo "vLLM $V pins flashinfer-python==$fi_pin, which the index lacks, and no later $series.x exists: set STAGE_FLASHINFER"; exit 3; }
  echo "NOTE: vLLM $V pins flashinfer-python==$fi_pin, which the index lacks; staging $fi_ver (set STAGE_FLASHINFER to choose)"
  pip download -q --no-deps -d "$work/w" $(plat manylinux_2_39) "flashinfer-python==$fi_ver"
fi

torch_pin=$(pin "$vw" torch)
if [[ -n $torch_pin && $torch_pin != "$IMAGE_TORCH" ]]; then
  pip download -q --no-deps -d "$work/t" $(plat manylinux_2_28) "torch==$torch_pin"
  tw=$(ls "$work"/t/torch-*.whl); mv "$tw" "$work/w/"; tw="$work/w/$(basename "$tw")"
  triton=$(spec "$tw" triton); nccl=$(spec "$tw" nvidia-nccl-cu13); cudnn=$(pin "$tw" nvidia-cudnn-cu13)
  [[ -n $triton ]] || { echo "torch $torch_pin: no triton requirement found in its metadata"; exit 3; }
  pip download -q --no-deps -d "$work/w" $(plat manylinux_2_28) "triton$triton"
  # NCCL's wheel is tagged manylinux_2_18: ask pip for that platform explicitly.
  [[ -n $nccl ]] && pip download -q --no-deps -d "$work/w" $(plat manylinux_2_18) "nvidia-nccl-cu13$nccl"
  if [[ -n $cudnn && ${cudnn%.*.*} != "$IMAGE_CUDNN" && ${STAGE_CUDNN:-1} != 0 ]]; then
    pip download -q --no-deps -d "$work/w" $(plat manylinux_2_27) "nvidia-cudnn-cu13==$cudnn"
  fi
  # torchvision built for this torch: release 0.(minor+15) pins torch 2.minor exactly (checked)
  t="0.$(( $(cut -d. -f2 <<< "$torch_pin") + 15 )).0"
  pip download -q --no-deps -d "$work/w" $(plat manylinux_2_28) "torchvision==$t"
  [[ $(pin "$(ls "$work"/w/torchvision-*.whl)" torch) == "$torch_pin" ]] || { echo "torchvision $t does not pin torch==$torch_pin"; exit 3; }
fi
treq=$(meta "$vw" | sed -n 's/^transformers\( *[<>=!~][^;]*\)\?.*/\1/p' | head -1 | tr -d ' ')
if [[ -n $treq ]] && ! python3 -c "import sys; from packaging.specifiers import SpecifierSet as S; sys.exit(0 if '$IMAGE_TRANSFORMERS' in S('$treq') else 1)"; then
  pip download -q --no-deps -d "$work/w" "transformers$treq"
fi
for s in "${SPECULATORS[@]}"; do pip download -q --no-deps -d "$work/w" "speculators==$s"; done

# Pack: a wheel over the unit size is split into parts of one unit each; the others fill units.
rm -rf "$DEST"; mkdir -p "$DEST"
: > "$DEST/WHEELS"
u=0; fill=$UNIT; cur=-1
for f in $(ls -S "$work"/w/*.whl); do
  n=$(basename "$f"); s=$(stat -c %s "$f")
  echo "$n $(sha256sum "$f" | cut -c1-64)" >> "$DEST/WHEELS"
  if (( s > UNIT )); then
    split -b "$UNIT" -d -a 2 "$f" "$work/$n.part"
    for p in "$work/$n".part*; do mkdir -p "$DEST/unit$u"; mv "$p" "$DEST/unit$u/"; u=$((u + 1)); done
  else
    if (( fill + s > UNIT )); then mkdir -p "$DEST/unit$u"; cur=$u; u=$((u + 1)); fill=0; fi
    mv "$f" "$DEST/unit$cur/$n"; fill=$((fill + s))
  fi
done
cp "$DEST/WHEELS" "$DEST/unit0/WHEELS"  # travels with the first unit
{ echo "vllm $V"; echo "flashinfer-python ${fi_ver:-none} (vLLM pins ${fi_pin:-none})"; echo "torch ${torch_pin:-image}"; } > "$DEST/unit0/STAGED"
cp "$DEST/unit0/STAGED" "$DEST/STAGED"
ls -d "$DEST"/unit* | xargs -n1 basename | sort -V > "$DEST/UNITS"
# Calls: units packed first-fit (largest first) into calls of <= 63 MiB with the checkout, at most 8
# units a call (carry takes 8 paths).
for un in $(cat "$DEST/UNITS"); do echo "$(find "$DEST/$un" -type f -printf '%s\n' | awk '{ s += $1 } END { print s }') $un"; done \
  | sort -rn | awk -v room=$(( CALL_LIMIT - checkout )) '
      { for (i = 1; i <= n; i++) if (used[i] + $1 <= room && count[i] < 8) break
        if (i > n) { n = i; used[i] = 0; count[i] = 0 }
        used[i] += $1; count[i]++; calls[i] = calls[i] " " $2 }
      END { for (i = 1; i <= n; i++) print substr(calls[i], 2) }' > "$DEST/CALLS"
cat "$DEST/STAGED"
echo "wheels: $(wc -l < "$DEST/WHEELS"); checkout $(awk -v c="$checkout" 'BEGIN { printf "%.2f", c / 1048576 }') MiB;" \
     "units of <= $(( UNIT / MIB )) MiB: $(wc -l < "$DEST/UNITS") in $(wc -l < "$DEST/CALLS") back-to-back calls ($DEST/CALLS)"
