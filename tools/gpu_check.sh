#!/bin/bash
# The device checks for a session that is lent a GPU, as one call (docs/gpu.md).
#
# Here first, once: kvikio and megatron-core are not on the GPU image, so carry their wheels (Python 3.12;
# megatron-core lets the gpu-report's Megatron part run, as the sixth run's third call did by hand):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
#     -d .whl 'kvikio-cu13==26.10.*' 'libkvikio-cu13==26.10.*' 'rapids-logger==0.3.*' 'megatron-core==0.16.1'
# Then the device tool: run(command="bash tools/gpu_check.sh", carry=[".whl"], timeout_s=540); the script
# keeps itself within BUDGET_S (default 480 s: the fifth run's parts took 380 s, and the block-groups
# A/B gets what is left of the last minute), so a machine started in about a minute leaves room in a
# 15-minute lease for a shorter second call.
# Everything lands in $OUT; the last lines printed are the report's summary.
set -u
case "${1:-}" in
    -h|--help) sed -n '2,/^set -u$/{/^set -u$/d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;;
    "") ;;
    *) echo "gpu_check.sh: takes no arguments (got '$1'); --help says what it runs" >&2; exit 2 ;;
esac
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/tba-gpu-check}
mkdir -p "$OUT"
if ls .whl/*.whl > /dev/null 2>&1; then
    if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl; then
        export PYTHONPATH=/tmp/site:$PWD
    else
        echo "the carried wheels did not install: no kvikio route in this run"
        export PYTHONPATH=$PWD
    fi
else
    echo "no .whl/ carried: no kvikio route in this run"
    export PYTHONPATH=$PWD
fi
python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1
python3 -c "import tba._uring, tba._shield" 2>/dev/null && echo "native extensions built" \
    || echo "a native extension did not build (see build.log): io_uring or the C exit is missing in this run"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__)"
mkdir -p /var/tmp/tba
export TBA_DIR=/var/tmp/tba
S=$SECONDS
for mode in none history; do
    for off in "" --early-stop-off; do timeout 40 python3 tools/checkpoint_early_stop.py $mode --steps 50 $off; done
done
for off in "" --early-stop-off; do
    TORCH_CUDA_SANITIZER=1 timeout 40 python3 tools/checkpoint_early_stop.py sanitizer --steps 50 $off
done
TBA_TEST_MEMORY_HISTORY=1 TORCH_CUDA_SANITIZER=1 timeout 120 python3 -m pytest -q -rA -p no:cacheprovider \
    tests/device/test_cuda.py -k no_leak > "$OUT/no-leak.log" 2>&1
echo "no-leak under the sanitizer and memory history: exit $? ($((SECONDS - S)) s so far)"
REPORT_S=$(( ${BUDGET_S:-480} - 60 - SECONDS ))
timeout $(( REPORT_S > 60 ? REPORT_S : 60 )) python3 -m tba gpu-report --out "$OUT/report" --steps 2 --skip-rok > "$OUT/report.log" 2>&1
echo "gpu-report: exit $? ($((SECONDS - S)) s so far)"
sed -n '/^## CUDA tests/,/^## ROK/p' "$OUT/report/gpu-report.md" 2>/dev/null | head -60
AB_S=$(( ${BUDGET_S:-480} - SECONDS ))
if [ "$AB_S" -gt 30 ]; then
    timeout "$AB_S" python3 tools/ab_block_groups.py --rounds 2 --sizes 64K --counts 400 --no-disk --no-keep \
        > "$OUT/ab-block-groups.log" 2>&1
    echo "block groups A/B: exit $? ($((SECONDS - S)) s so far); rows of each round:"
    grep -E "^== |KiB|MiB" "$OUT/ab-block-groups.log" | head -20
fi
