#!/usr/bin/env bash
# The one command for the GPU machine, which has CUDA but no package access (docs/BUILDING.md):
# configure with the Debian dependencies carried in the working tree (.gpudeps/: the packages'
# files unpacked with dpkg -x), build, run the GPU tests, then the benchmark. Logs and tables go to
# $OUT.
# Usage: scripts/gpu-check.sh [tests|bench|layer|layer-sanitize|sanitize|sanitize-all|all|all-sanitize|none] [bench args]
# sanitize: a quick subset (five runs: the operator's varlen / state / decode cases) under the four
# compute-sanitizer tools; all-sanitize: tests, bench, then that quick subset (not sanitize-all).
# ab REV [bench args]: kda-bench of .ab/REV (scripts/ab-prepare.sh REV) and of this tree, run
# alternately (KDA_AB_ROUNDS rounds, default 3), compared as ratios by scripts/bench-ab.py.
# sanitize-all: every GPU test binary, every case, under memcheck, racecheck, initcheck and synccheck
# (KDA_SANITIZER_TIMEOUT seconds each, default 480; KDA_SANITIZER_JOBS at once, default 8; the
# 2^31-element test serially). KDA_SANITIZE_PART=operator (test_kda_operator's runs) or others
# (the other binaries) runs half of it, for runs shorter than the whole (~15 minutes);
# KDA_SANITIZE_TOOLS="memcheck ..." only the tools named (default all four).
# layer: the whole layer's decode kernels: the few-row GEMM tests and the layer's CUDA cases (also
# with every GEMM of 2 to 256 rows on the warpgroup kernel), kda-gemv-probe and its --warpgroup
# table, kda-layer-bench, then its decode rows twice over the variants KDA_LAYER_VARIANTS names
# (default "default"; also input-cublas: the input projection on cuBLAS, warpgroup9 / warpgroup:
# the warpgroup kernel for the GEMMs of 9 / 2 to 256 rows, gemmex: the cuBLAS GEMMs through
# cublasGemmEx instead of cuBLASLt), alternating.
# layer-sanitize: memcheck and racecheck over the layer's
# decode-kernel, verify and records cases and the GEMM test (a run of its own: with layer's runs
# it takes over ten minutes).
# KDA_GPU_TARGETS="a b" builds only those targets (default: everything).
set -uo pipefail
what=${1:-all}; shift || true
ab_rev=
if [ "$what" = ab ]; then ab_rev=${1:?ab needs a revision (scripts/ab-prepare.sh REV first)}; shift; KDA_GPU_TARGETS=${KDA_GPU_TARGETS:-kda-bench}; fi
[ "$what" = layer ] && KDA_GPU_TARGETS=${KDA_GPU_TARGETS:-"kda-layer-bench kda-gemv-probe test_layer_gemv_cuda test_layer"}
[ "$what" = layer-sanitize ] && KDA_GPU_TARGETS=${KDA_GPU_TARGETS:-"test_layer_gemv_cuda test_layer"}
root=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/kda-out}
mkdir -p "$OUT"
build=${KDA_GPU_BUILD:-/tmp/kda-gpu-build}
export LD_LIBRARY_PATH=$root/.gpudeps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu \
  --format=csv > "$OUT/nvidia-smi.txt" 2>&1
cat "$OUT/nvidia-smi.txt"
t0=$(date +%s)
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$root/.gpudeps/usr" \
  -DKDA_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a > "$OUT/configure.log" 2>&1 \
  || { tail -40 "$OUT/configure.log"; exit 1; }
cmake --build "$build" -j16 ${KDA_GPU_TARGETS:+--target $KDA_GPU_TARGETS} > "$OUT/build.log" 2>&1 \
  || { grep -E "error|Error" -A4 "$OUT/build.log" | head -80; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
rc=0
if [ "$what" = tests ] || [ "$what" = all ] || [ "$what" = all-sanitize ]; then
  # -V keeps every test's output (each case's measured errors, for the record) in one pass; a
  # second serial run of the binaries for it took longer than the tests themselves.
  ctest --test-dir "$build" -L gpu -V -j4 --timeout 300 > "$OUT/ctest-gpu.log" 2>&1 || rc=1
  grep -E "tests passed|tests failed|\*\*\*" "$OUT/ctest-gpu.log" | tail -40
fi
if [ "$what" = bench ] || [ "$what" = all ] || [ "$what" = all-sanitize ]; then
  "$build/bench/kda-bench" "$@" 2>&1 | tee "$OUT/bench.md" || rc=1
fi
if [ "$what" = sanitize ] || [ "$what" = all-sanitize ]; then
  # compute-sanitizer over the GPU tests (after the benchmark, so that a cut-short run keeps the
  # tables), on case subsets that keep each tool under KDA_SANITIZER_TIMEOUT seconds.
  t=$build/tests
  run_tool() {  # tool log binary [doctest args]
    local tool=$1 log=$2; shift 2
    timeout ${KDA_SANITIZER_TIMEOUT:-40} compute-sanitizer --tool "$tool" --nvtx yes --error-exitcode 1 "$@" > "$OUT/$log" 2>&1
    local r=$?
    echo "compute-sanitizer $tool $(basename "$1") ${*:2}: exit $r, $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/$log" | tail -1)"
    [ $r -eq 0 ] || rc=1
  }
  # test_kda_operator's CUDA cases ("[cuda]"); registry entries are subcases, picked with -sc.
  op=$t/test_kda_operator
  varlen='-tc=*matches the CPU backend [cuda],*zero sequences*[cuda]'
  run_tool memcheck san-memcheck-prefill.log "$op" \
    '-tc=*matches the CPU backend [cuda],*zero sequences*[cuda],*in-place state*[cuda],*bad input*[cuda]' \
    '-sc=*varlen*,state in *'
  run_tool memcheck san-memcheck-decode.log "$op" '-tc=*decode*[cuda]'
  run_tool racecheck san-racecheck.log "$op" "$varlen" '-sc=*varlen*'
  run_tool initcheck san-initcheck.log "$op" '-tc=*matches the CPU backend [cuda],*in-place state*[cuda]' \
    '-sc=state in *'
  run_tool synccheck san-synccheck.log "$op" "$varlen" '-sc=*varlen*'
fi
if [ "$what" = ab ]; then
  src=$root/.ab/$ab_rev
  [ -d "$src" ] || { echo "no $src: run scripts/ab-prepare.sh $ab_rev and bring .ab/ with the working tree"; exit 1; }
  abuild=${build}-ab-$ab_rev
  cmake -S "$src" -B "$abuild" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$root/.gpudeps/usr" \
    -DKDA_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a > "$OUT/configure-ab.log" 2>&1 \
    && cmake --build "$abuild" -j16 --target kda-bench > "$OUT/build-ab.log" 2>&1 \
    || { grep -E "error|Error" -A4 "$OUT/build-ab.log" "$OUT/configure-ab.log" | head -60; exit 1; }
  runs=()
  for round in $(seq 1 ${KDA_AB_ROUNDS:-3}); do
    "$abuild/bench/kda-bench" "$@" > /tmp/ab-a-$round.md 2>&1 || rc=1
    "$build/bench/kda-bench" "$@" > /tmp/ab-b-$round.md 2>&1 || rc=1
    runs+=(/tmp/ab-a-$round.md /tmp/ab-b-$round.md)
  done
  cp /tmp/ab-b-1.md "$OUT/bench.md"
  tar -C /tmp -cf "$OUT/ab-runs.tar" "${runs[@]#/tmp/}"  # every run, for a later look
  python3 "$root/scripts/bench-ab.py" "$ab_rev" "this tree" "${runs[@]}" | tee "$OUT/bench-ab.md"
fi
if [ "$what" = layer ]; then
  # Under ten minutes with the build, and few files in $OUT (the decode variants share one).
  t=$build/tests
  { timeout 300 "$t/test_layer_gemv_cuda"; timeout 400 "$t/test_layer" '-tc=*[cuda]'
    KDA_LAYER_SMALL_GEMM=warpgroup timeout 400 "$t/test_layer" '-tc=*[cuda]'; } \
    > "$OUT/layer-tests.log" 2>&1 || rc=1
  grep -E '^\[doctest\] (test cases|assertions)' "$OUT/layer-tests.log"
  { timeout 200 "$build/bench/kda-gemv-probe"; timeout 200 "$build/bench/kda-gemv-probe" --warpgroup; } \
    > "$OUT/gemv-probe.md" 2>&1 || rc=1
  timeout 120 "$build/bench/kda-layer-bench" "$@" > "$OUT/layer-bench.md" 2>&1 || rc=1
  # The decode rows again, the variants alternating; one file, a header a run.
  for round in 1 2; do
    for variant in ${KDA_LAYER_VARIANTS:-default}; do
      case "$variant" in default | input-cublas | warpgroup9 | warpgroup | gemmex) ;;
        *) echo "KDA_LAYER_VARIANTS: unknown variant '$variant'"; rc=1; continue ;; esac
      env_args=()
      [ "$variant" = input-cublas ] && env_args=(KDA_LAYER_INPUT_GEMM=cublas)
      [ "$variant" = warpgroup9 ] && env_args=(KDA_LAYER_SMALL_GEMM=warpgroup9)
      [ "$variant" = warpgroup ] && env_args=(KDA_LAYER_SMALL_GEMM=warpgroup)
      [ "$variant" = gemmex ] && env_args=(KDA_LAYER_CUBLAS_API=gemmex)
      echo "## $variant, round $round" >> "$OUT/layer-bench-decode.md"
      env "${env_args[@]}" timeout 60 "$build/bench/kda-layer-bench" --decode-only "$@" \
        >> "$OUT/layer-bench-decode.md" 2>&1 || rc=1
    done
  done
  grep -E "^## |decode B = 1 " "$OUT/layer-bench-decode.md" | grep -v "| 3 |\|| 18 |\|| 2 |" | head -40
fi
if [ "$what" = layer-sanitize ]; then
  # memcheck and racecheck over the whole layer's decode kernels (racecheck of the three layer
  # cases took about 300 s on the H200).
  t=$build/tests
  for tool in memcheck racecheck; do
    timeout 400 compute-sanitizer --tool "$tool" --error-exitcode 1 "$t/test_layer" \
      '-tc=*every decode kernel*[cuda],*verify step keeps*[cuda],*records verify step and its commit*[cuda]' \
      > "$OUT/layer-$tool.log" 2>&1 || rc=1
    grep -hE 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/layer-$tool.log"
  done
  for tool in memcheck racecheck; do
    timeout 300 compute-sanitizer --tool "$tool" --error-exitcode 1 "$t/test_layer_gemv_cuda" \
      > "$OUT/layer-gemv-$tool.log" 2>&1 || rc=1
    grep -hE 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/layer-gemv-$tool.log"
  done
fi
if [ "$what" = sanitize-all ]; then
  t=$build/tests
  logs=/tmp/kda-sanitizer-logs
  rm -rf "$logs"; mkdir -p "$logs"
  one() {  # tool binary [doctest test-case filter[|subcase filter]; '?' stands for a space]
    local tool=$1 bin=$2 filter=${3:-} s0=$(date +%s)
    local log=$logs/$tool-$bin${filter:+-$(printf %s "$filter" | md5sum | cut -c1-6)}.log
    local args=()
    [ "$bin" = test_kda_operator ] && args=("-tc=${filter%%|*}")  # its CPU cases need no tool
    [ "$bin" = test_kda_operator ] && [ -z "$filter" ] && args=("-tc=*[cuda]")
    [ "$bin" = test_layer ] && args=("-tc=*[cuda]")
    # test_layer's CUDA cases in shards by position, FIRST-LAST or FIRST- (doctest's --first and
    # --last count the cases that pass the filter, from 1): racecheck over all of them in one
    # process runs past any limit a run can take.
    if [ "$bin" = test_layer ] && [ -n "$filter" ]; then
      args+=("--first=${filter%%-*}")
      [ -n "${filter#*-}" ] && args+=("--last=${filter#*-}")
    fi
    case "$bin" in test_engine_core | test_engine_whole | test_c_api | test_batch_metadata | test_engine_threads | test_model_families | test_parallel_cuda)
      args=("-tc=*[cuda]") ;;
    esac
    [[ "$filter" == *"|"* ]] && args+=("-sc=${filter#*|}")
    # The system NCCL's ncclCommInitAll probes kernels it carries no image of for the GPU, and
    # memcheck reports each cudaErrorNoKernelImageForDevice NCCL gets back (none in the project;
    # docs/SANITIZERS.md): the NCCL case runs under the other tools.
    [ "$bin" = test_parallel_cuda ] && [ "$tool" = memcheck ] && args+=("-tce=nccl communicator*")
    # Under racecheck and initcheck the 2^31-element case never completed (~50 GB tracked) and the
    # leak test measures the tool's own device memory (docs/SANITIZERS.md): memcheck and
    # synccheck run them.
    [ "$bin" = test_hardening_cuda ] && { [ "$tool" = racecheck ] || [ "$tool" = initcheck ]; } \
      && args=("-tce=cuda prefill beyond 2^31*,*device memory back to its baseline")
    # A decreasing device cu_seqlens entry under a split plan: the prepare kernel's owner search
    # and the recurrence then disagree on which slots hold which chunks, and the recurrence reads
    # records nobody wrote (in bounds; the call reports the list through the status word and its
    # outputs are undefined, kda.hpp). initcheck reports each such read and the subcase ran past
    # 240 s under it; every other tool runs it.
    [ "$bin" = test_validation_cuda ] && [ "$tool" = initcheck ] \
      && args=("-sce=a list long enough for a split plan*")
    timeout ${KDA_SANITIZER_TIMEOUT:-480} compute-sanitizer --tool "$tool" --nvtx yes --error-exitcode 1 \
      "$t/$bin" "${args[@]}" > "$log" 2>&1
    local r=$?
    local summary=$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -1)
    local cases=$(grep -E '^\[doctest\] test cases:' "$log" | tail -1)
    echo "| $tool | $bin $filter | exit $r | $summary | $cases | $(( $(date +%s) - s0 )) s |"
  }
  export -f one; export t logs
  part=${KDA_SANITIZE_PART:-all}
  tools=${KDA_SANITIZE_TOOLS:-memcheck racecheck initcheck synccheck}
  op_part=false; others_part=false
  [ "$part" = operator ] || [ "$part" = all ] && op_part=true
  [ "$part" = others ] || [ "$part" = all ] && others_part=true
  bins=
  $op_part && bins="test_kda_operator"
  $others_part && bins="$bins test_validation_cuda test_c_api test_engine_core test_engine_whole test_layer test_batch_metadata test_engine_threads test_layer_gemv_cuda test_parallel_cuda test_model_families"
  {
    echo "| tool | binary | exit | summary | doctest | time |"
    echo "|---|---|---|---|---|---|"
    # racecheck of the operator in fifteen shards (together its CUDA test cases, each once): in one
    # run it does not finish within 480 s (the CPU-backend comparison alone takes ~600 s under
    # racecheck), so that comparison's subcases are split by name into eight shards and the other
    # test cases into seven, each under the limit with eight processes at once (the longest,
    # "H96*,split*", ~430 s). A comma in a case's name is matched by '?' (-tc splits at commas).
    { for tool in $tools; do for b in $bins; do
        if [ $b = test_layer ]; then
          # Cases 16 and 17 take most of 500 s together under racecheck: apart.
          for shard in 1-5 6-10 11-15 16-16 17-17 18-20 21-25 26-30 31-35 36-40 41-; do
            echo "$tool $b $shard"
          done
        else
          [ $tool = racecheck ] && [ $b = test_kda_operator ] || echo "$tool $b"
        fi; done; done
      $op_part && [[ " $tools " == *" racecheck "* ]] && for shard in 'prefill?matches?the?CPU?backend?[cuda]|T=*' \
        'prefill?matches?the?CPU?backend?[cuda]|varlen*,KDA*,strong*' \
        'prefill?matches?the?CPU?backend?[cuda]|long*,very*,state*' \
        'prefill?matches?the?CPU?backend?[cuda]|H96*,split*' \
        'prefill?matches?the?CPU?backend?[cuda]|scale*' \
        'prefill?matches?the?CPU?backend?[cuda]|pipelined:?H3*,pipelined:?H24*' \
        'prefill?matches?the?CPU?backend?[cuda]|pipelined:?H23*' \
        'prefill?matches?the?CPU?backend?[cuda]|pipelined:?schedule*' \
        'prefill?matches?the?fp64*[cuda],prefill:?a?decay*[cuda],decode?matches*[cuda],decode:?8-byte*[cuda]' \
        'prefill?n?tokens*[cuda],prefill?is?bitwise*[cuda],split?round*[cuda],in-place*[cuda]' \
        'prefill?through?state?slots*[cuda]' \
        'prefill:?a?slot*[cuda],prefill:?the?host?copy*[cuda]' \
        'segment*[cuda],transitions*[cuda],apply_transition*[cuda],*zero?sequences*[cuda],*graph*[cuda],prefill?reports*[cuda]' \
        'decode:?1??2?or?4*[cuda],*verify*[cuda],commit*[cuda],*fold*[cuda]' \
        'slot?copy*[cuda],slot?zeroing*[cuda],*checkpoint*[cuda]'; do
        echo "racecheck test_kda_operator $shard"; done; } \
      | xargs -P ${KDA_SANITIZER_JOBS:-8} -L 1 bash -c 'one "$0" "$1" "$2"'
    # test_hardening_cuda after them, alone: its leak test measures device-wide free memory, which
    # other processes disturb, and its 2^31-element case needs ~50 GB.
    $others_part && for tool in $tools; do
      one $tool test_hardening_cuda
    done
  } | tee "$OUT/sanitizers.md"
  grep -qE "\| exit [1-9]" "$OUT/sanitizers.md" && rc=1
  tar -czf "$OUT/sanitizer-logs.tar.gz" -C "$logs" .
fi
exit $rc
