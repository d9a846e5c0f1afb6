#!/bin/sh
# Every GPU benchmark and the GPU tests on one H200, in the order that pays for fla's Triton compilation once:
# the KDA op first (it compiles the chunk kernels the others reuse), then tests, decode, prefill, training,
# the vision tower and serving. Each step has its own time limit, so one slow step cannot eat the rest.
#   sh benchmarks/run_h200.sh [STEP ...]   STEP in: kda tests serve-tests kernels kbench decode prefill train
#   train-ckpt moe mxfp4 vision serve serve64 sampler profile gemms ncu pack k3-shaped cold
#   (default: all but kernels, kbench, train-ckpt, profile, gemms, ncu, pack, k3-shaped and cold). cold = a first
#   training step from an empty Triton cache (issue 23's start-fast target), recording this GPU's table section;
#   gemms = every matrix product of a `small` training step by shape, each alone against a square GEMM's rate.
#   ncu = Nsight Compute's counters for each kernel of a graphed decode step at batch 64 and 1 (benchmarks/ncu_decode.py). tests = every
#   GPU test (k3's Triton kernel tests included), in TEST_WORKERS (4) processes where pytest-xdist is installed
#   (scripts/gpu-wheels.sh fetches it), TESTS_LIMIT (480) s: on an H100 at 4 processes 863 ran in 480 s, at 8 processes
#   905 in 520 s (all but five of test_gpu.py: TESTS_LIMIT=560 in a 600 s call);
#   kernels = the Triton kernel tests and the GPU tests that need no new fla compile; serve-tests = the serving path's CUDA tests alone (prefill graphs and
#   the static KDA layout, async output, fla's graph mode); serve64 = the serving bench at 64 streams only (set K3_TRITON to time
#   opt-in kernels; SERVE_BATCH_TOKENS=8192: steps of up to 8,192 tokens, default 2,048; SERVE_FLAGS: more engine
#   flags, e.g. --prefill-graphs, or --no-async-output for the synchronous engine; serve and serve64 run with async
#   output, the engine's default since session 16); sampler = the batched
#   sampler against a per-row loop on the GPU;
#   kbench-ab = k3's kernel bench alternating main, $AB_SRC, main, $AB_SRC (AB_SRC: another tree's src/, e.g.
#   `mkdir ab && git archive BRANCH src | tar x -C ab` carried, AB_SRC=$PWD/ab/src);
#   k3-shaped = the released widths in 4 layers, 896 MXFP4 experts (57.6 GB made on the card): decode at batch 1,
#   8, 64 and serving at 64 streams against the byte roofline (issue 22);
#   pack = the Triton cache as 15 MB pieces $OUT/tcache.tgz.aa, .ab, ...
#   to carry back: put them in .tpack/ and carry that; the script merges .tpack/tcache.tgz.* into the cache.
# Results: $OUT/<step>.log and the scripts' $OUT/<name>.json (OUT defaults to ./gpu-results).
# TRITON_CACHE_DIR defaults to ./.tcache: keep it between calls (and carry it) to skip recompiling.
# Without fla (or the serving tests' fastapi and llguidance) importable, the wheels in .whl/ (carried: the GPU machine
# has no network; `sh scripts/gpu-wheels.sh` downloads them) go to /tmp/k3-site.
set -u
OUT=${OUT:-gpu-results}
export OUT TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.tcache} PYTHONUNBUFFERED=1
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD/src
if ! python3 -c "import fla, fastapi, llguidance" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then  # carried (no network)
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/k3-site .whl/*.whl
    export PYTHONPATH=/tmp/k3-site:$PYTHONPATH
fi
mkdir -p "$OUT" "$TRITON_CACHE_DIR"
if ls .tpack/tcache.tgz.* >/dev/null 2>&1; then  # merged in: entries are content-addressed
    cat .tpack/tcache.tgz.* | tar xzf - -C "$TRITON_CACHE_DIR"  # fla's compiled kernels and autotune choices
fi
steps=${*:-kda tests decode prefill train moe vision serve}

run() {  # run NAME SECONDS CMD...: time-limited, output to the terminal and $OUT/NAME.log
    name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit}s) $(date -u +%H:%M:%S)"
    # SIGINT first: pytest still prints its failures and summary, a benchmark keeps the rows it saved
    timeout -s INT -k 10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | tail -30
}

for step in $steps; do
    case $step in
        kda) run kda 540 python3 benchmarks/bench_gpu_kda.py ;;
        # 4 processes: fla compiles its kernels for minutes, on the CPU, and the tests share one GPU well. -v: a
        # run cut by its limit may die in a compile before pytest prints a summary; the log still names each result
        tests) xdist=$(python3 -c "import xdist" 2>/dev/null && echo "-n ${TEST_WORKERS:-4}")
            run tests "${TESTS_LIMIT:-480}" python3 -m pytest -v -rfE -p no:cacheprovider $xdist tests/test_gpu.py \
                tests/test_mla_decode_triton.py tests/test_attn_res_triton.py tests/test_norm_triton.py \
                tests/test_conv_triton.py tests/test_situ_triton.py tests/test_mxfp4_triton.py \
                tests/test_mxfp4_layout.py tests/test_cross_entropy_triton.py tests/test_tuning_triton.py \
                tests/test_serve_split_steps.py tests/test_serve_host_syncs.py tests/test_serve_expert_balance.py \
                tests/test_kda_decode_triton.py tests/test_router_triton.py tests/test_attn_res_norm_triton.py \
                tests/test_block_grads.py tests/test_shared_input_grad.py tests/test_sigmoid_gate_triton.py \
                tests/test_mla_keys_triton.py tests/test_qk_norm_fold.py \
                tests/test_kda_fla_lean.py tests/test_inference_launchers.py tests/test_expert_skip_triton.py \
                tests/test_serve_decode_layout.py tests/test_serve_async_output.py \
                tests/test_gemv_triton.py tests/test_mla_static_decode_triton.py tests/test_moe_expert_major_triton.py \
                tests/test_gemv_fusions.py tests/test_varlen_attention.py tests/test_serve_mla_prefill.py \
                tests/test_serve_kda_glue.py tests/test_serve_prefill_graphs.py tests/test_decode_compile_graph.py \
                tests/test_tuned_launch.py tests/test_decode_folds.py tests/test_conv_varlen_triton.py \
                tests/test_serve_warm_up.py tests/test_document_attention.py tests/test_pdl.py tests/test_precompile_table.py ;;
        serve-tests) xdist=$(python3 -c "import xdist" 2>/dev/null && echo "-n 3")
            run serve-tests 300 python3 -m pytest -q -rfE -p no:cacheprovider $xdist tests/test_serve_prefill_graphs.py \
                tests/test_serve_async_output.py tests/test_kda_fla_lean.py -k cuda ;;
        decode) run decode 300 python3 benchmarks/bench_gpu_decode.py --compile ;;
        prefill) run prefill 240 python3 benchmarks/bench_gpu_prefill.py ;;
        kbench) run kbench 120 python3 benchmarks/bench_gpu_kernels.py ;;
        kbench-ab) for i in 1 2; do  # alternating, so that a drift of the card's speed hits both sides
                (OUT=$OUT/main$i && mkdir -p "$OUT" && run kbench 120 python3 benchmarks/bench_gpu_kernels.py)
                (OUT=$OUT/ab$i PYTHONPATH=$AB_SRC:$PYTHONPATH && mkdir -p "$OUT" &&
                    run kbench 120 python3 benchmarks/bench_gpu_kernels.py)
            done ;;
        profile) run profile 240 python3 benchmarks/profile_gpu.py --compile ;;
        gemms) run gemms 180 python3 benchmarks/gemm_census.py ;;
        ncu) run ncu 420 python3 benchmarks/ncu_decode.py --batches 64,1 --out "$OUT" ;;
        train) run train 240 python3 benchmarks/bench_gpu_train.py ;;
        # a fresh machine's first step (its own empty Triton cache), then this GPU's choices and compiles merged into
        # a copy of the shipped table: $OUT/autotune_table.json, to commit where it adds kernels the table lacks
        cold) cp src/k3/ops/autotune_table.json "$OUT/autotune_table.json" &&
            run cold 240 env TRITON_CACHE_DIR="$(mktemp -d)" python3 benchmarks/bench_cold_start.py \
                --save-table "$OUT/autotune_table.json" ;;
        train-ckpt) run train-ckpt 240 python3 benchmarks/bench_gpu_train.py --activation-checkpointing ;;
        kernels) run kernels 240 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_attn_res_triton.py tests/test_situ_triton.py \
            tests/test_norm_triton.py tests/test_conv_triton.py tests/test_mla_decode_triton.py tests/test_gpu.py \
            tests/test_mxfp4_triton.py -k "not graphed and not chunk" ;;
        moe) run moe 120 python3 benchmarks/bench_gpu_moe.py ;;
        mxfp4) run mxfp4 240 python3 benchmarks/bench_mxfp4_gemm.py ;;
        k3-shaped) run k3-shaped 290 python3 benchmarks/bench_k3_shaped.py ;;
        vision) run vision 120 python3 benchmarks/bench_gpu_vision.py ;;
        sampler) run sampler 60 python3 benchmarks/bench_serve_host.py --sampler --device cuda ;;
        serve64) run serve64 480 python3 benchmarks/bench_serve.py --preset small --device cuda --dtype bfloat16 \
            --concurrency 64 --num-prompts 1 --prompts-per-concurrency 8 --turns 2 --input-len 256 \
            --output-len 128 --memory-gib 16 --num-state-slots 512 --max-num-seqs 64 \
            --max-batch-tokens "${SERVE_BATCH_TOKENS:-2048}" --block-size 256 --match-unit 16 ${SERVE_FLAGS:-} \
            --json "$OUT/serve64${SERVE_BATCH_TOKENS:+-$SERVE_BATCH_TOKENS}.json" ;;
        serve) run serve 420 python3 benchmarks/bench_serve.py --preset small --device cuda --dtype bfloat16 \
            --concurrency 1,8,32,64 --num-prompts 1 --prompts-per-concurrency 2 --turns 2 --input-len 256 \
            --output-len 128 --memory-gib 16 --num-state-slots 512 --max-num-seqs 64 --max-batch-tokens 2048 \
            --block-size 256 --match-unit 16 ${SERVE_FLAGS:-} --json "$OUT/serve.json" ;;
        # Triton loads a cached kernel from its .json and .cubin (and the launcher .so): the IR stages are left out
        pack) tar czf - -C "$TRITON_CACHE_DIR" --exclude='*.ttir' --exclude='*.ttgir' --exclude='*.llir' \
            --exclude='*.ptx' --exclude='*.source' . | split -b 15m - "$OUT/tcache.tgz." && ls -l "$OUT"/tcache.tgz.* ;;
        *) echo "unknown step $step" >&2; exit 2 ;;
    esac
done
