#!/usr/bin/env bash
# The dev extra's tools the GPU bundle cannot carry, as parts for the lent GPU machine.
#
#   bash scripts/gpu_extras.sh [DEST] [REQUIREMENT ...]     (default: .gpu/extra sae-lens==6.54.12 datasets ray==2.60.0)
#
# ../shared/gpu/bundle.sh takes wheels only, and sae-lens needs two packages published only as
# source (py2store, transformers-stream-generator): without them tests/test_sae.py (sae-lens's own
# encoding beside nnvllm's), the sae_lens cache tests and the Ray tests skip on the GPU. This script
# resolves the requirements beside the bundle's (vLLM 0.33, nnsight 0.8.1 and the image's packages,
# as bundle.sh does), downloads what that adds, builds the source-only ones into wheels here (pure
# Python), and cuts them into DEST/1, DEST/2 ... of at most 40 MiB, so that each part and the tree
# stay under what one command carries. On the machine, after the bundle's parts:
#   one command per part:  carry [".gpu/extra/K", ".gpu/extra/stage.sh"]  command: bash .gpu/extra/stage.sh K
#   then, before the tests: bash .gpu/extra/stage.sh install
# which installs them into the bundle's /root/site and imports each.
set -euo pipefail
dest="${1:-.gpu/extra}"; shift || true
reqs=("$@"); [ ${#reqs[@]} -gt 0 ] || reqs=(sae-lens==6.54.12 datasets ray==2.60.0)
shared="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../shared/gpu" && pwd)"
py="${PYTHON:-python3}"
work="$(mktemp -d)"; trap 'rm -rf "$work"' EXIT
cd "$work"
command -v uv >/dev/null || "$py" -m pip install -q uv >/dev/null 2>&1
base=(vllm==0.33.0 nnsight==0.8.1 ipywidgets nbmake ipykernel ruff)
free=$(cut -d= -f1 "$shared/device-versions.txt")
grep -v -x -F -f <(echo "$free") "$shared/device-packages.txt" | sed 's/$/ ; sys_platform == "never"/' > overrides.txt
lock() {  # requirements file, lock file: resolved for the image's Python, the image's packages as given
  uv pip compile "$1" --python-version 3.12 --python-platform x86_64-manylinux_2_28 --override overrides.txt \
    --no-header --no-annotate -q -o "$2"
}
printf '%s\n' "${base[@]}" > base.in; printf '%s\n' "${base[@]}" "${reqs[@]}" > all.in
lock base.in base.txt; lock all.in all.txt
grep -v -x -F -f base.txt all.txt > extra.txt || true
echo "gpu_extras: $(wc -l < extra.txt) packages beyond the bundle"
mkdir whl src
while read -r r; do
  "$py" -m pip download -q --no-deps --python-version 3.12 --implementation cp --only-binary=:all: \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      --platform linux_x86_64 -d whl "$r" >/dev/null 2>&1 \
    || { "$py" -m pip download -q --no-deps --no-binary=:all: -d src "$r" >/dev/null 2>&1 \
         && echo "gpu_extras: $r has no wheel; building one from its source"; } \
    || { echo "gpu_extras: could not download $r" >&2; exit 1; }
done < extra.txt
for s in src/*; do if [ -e "$s" ]; then "$py" -m pip wheel -q --no-deps -w whl "$s" >/dev/null; fi; done
[ "$(ls whl | wc -l)" -eq "$(wc -l < extra.txt)" ] || { echo "gpu_extras: $(ls whl | wc -l) wheels for $(wc -l < extra.txt) packages" >&2; exit 1; }
tar -C whl -cf extra.tar . && split -b 40M -d extra.tar part-
cd - >/dev/null
rm -rf "$dest"; n=0
for p in "$work"/part-*; do n=$((n + 1)); mkdir -p "$dest/$n"; cp "$p" "$dest/$n/"; done
cat > "$dest/stage.sh" <<'EOF'
#!/usr/bin/env bash
# bash stage.sh K: keep part K in /root/extra; bash stage.sh install: install every part's wheels
# into the bundle's /root/site (after the bundle's last part) and import each distribution.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
mkdir -p /root/extra
if [ "$1" != install ]; then cp "$here/$1"/part-* /root/extra/; echo "extra part $1 kept"; exit 0; fi
rm -rf /root/extrawhl; mkdir -p /root/extrawhl
cat /root/extra/part-* | tar -C /root/extrawhl -xf -
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /root/site /root/extrawhl/*.whl \
  > /root/pip_extra.log 2>&1 || { echo "extra: pip install failed:"; tail -5 /root/pip_extra.log; exit 1; }
source /root/nnvllm-gpu.env
python3 -c "import importlib as i, importlib.metadata as m, sys; [print('extra:', d, m.version(d), i.import_module(d.replace('-', '_')).__name__) for d in sys.argv[1:]]" NAMES
EOF
names=$(printf '%s\n' "${reqs[@]}" | sed 's/[=<>!~].*//' | tr '\n' ' ')
sed -i "s/NAMES\$/$names/" "$dest/stage.sh"
echo "gpu_extras: $n parts in $dest/ ($(du -sh "$dest" | cut -f1)); on the machine, after the bundle's last part:"
for i in $(seq 1 "$n"); do
  echo "  command: bash $dest/stage.sh $i   carry [\"$dest/$i\", \"$dest/stage.sh\"]"
done
echo "  then, before the tests: bash $dest/stage.sh install"
