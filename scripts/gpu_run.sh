#!/usr/bin/env bash
# Run the GPU figures on a lent H200 host from the repo root (the device tool's machine):
#   bash scripts/gpu_run.sh STAGE...   with STAGE in doctor, pytest, single[-coalesced|-pack|-p2d8], cross, split,
#                                      overhead, threads, direct (issue 13's rows), long (131,072 tokens and the
#                                      token sweep), two-gpu (needs two GPUs: prefill on 0, decode on 1),
#                                      issue20 (issue 20's one-H200 goal rows: issue20a then issue20b, one device call each),
#                                      mapped-pytest (tests/gpu: the mapped path over CUDA IPC), issue28 (issue 28's
#                                      one-H200 rows: issue28a then issue28b, one device call each), profile28 and
#                                      profile28b (where the decode worker's time goes on the mapped path), copier28
#                                      (what each call inside the mapped path's copier costs, both table paths)
#   DRY_RUN=1 bash scripts/gpu_run.sh STAGE...   prints every command a stage would run and runs none
# Needs the CPython 3.12 wheels of nixl, nixl-cu13, msgspec and pyzmq in .whl/ (built outside
# this repository, plus the pure-Python nixl wheel). Writes JSON, plots and logs under $OUT (default ./out).
set -u
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
if [ -z "${DRY_RUN:-}" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
# Without it UCX moves GPU bytes over TCP on hosts without NVLink (docs/tuning.md#cuda-ipc). Multicast stays off (device tool rule).
export UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
ht() {  # HT_TIMEOUT (seconds), when set, bounds the command
    if [ -n "${DRY_RUN:-}" ]; then echo "(dry run: not run)"; return; fi
    ${HT_TIMEOUT:+timeout "$HT_TIMEOUT"} python3 -m hybrid_transfer "$@"
}
say() { echo "+ $*"; }  # every stage prints the exact command it runs
BIG="--preset qwen3.5-397b-a17b --tokens 8192 --requests ${REQUESTS:-8} --concurrency ${CONCURRENCY:-4} --rounds ${ROUNDS:-3}"
SMALL="--preset qwen3.5-0.8b --tokens 2048 --requests 16 --concurrency 4 --rounds ${ROUNDS:-3}"
SWEEP="--sweep fragmentation --sweep-values 0,1"
# Long context: one request per round fits one H200 with --verify (sizing.device_bytes: ~75 GiB coalesced,
# ~94 GiB pack for P2 -> D8 at 131,072 tokens; 2 requests need ~128 / ~166 GiB). The bench refuses more.
LONG="--preset qwen3.5-397b-a17b --requests ${LONG_REQUESTS:-1} --concurrency 1 --warmup 1 --rounds ${ROUNDS:-3}"
LONG_MODE=${LONG_MODE:-pack}  # the chosen mode for P2 -> D8 (pack or auto)

bench() {  # name, args...
    local name=$1; shift
    echo "=== bench $name"
    echo "+ python3 -m hybrid_transfer bench --device cuda --verify $SWEEP $* --json $OUT/$name.json"
    # Only the JSON (and a plot where asked) goes to $OUT (the device tool brings back at most 8 files);
    # the summary and time-split tables go to stdout.
    ht bench --device cuda --verify $SWEEP "$@" --json "$OUT/$name.json" 2>&1 | grep -v '^\s*$' | tail -n "${TAIL:-32}"
    return "${PIPESTATUS[0]}"  # the bench's own status (a fallback row may follow a failed one)
}

for stage in "$@"; do
    case $stage in
        doctor) say "python3 -m hybrid_transfer doctor --device cuda [--json > $OUT/doctor.json]"
            nvidia-smi -L; ht doctor --device cuda --json > "$OUT/doctor.json"; ht doctor --device cuda ;;
        pytest) say "python3 -m pytest -q -rs tests/engine/test_pack_cuda.py tests/engine/test_gather_scatter.py"
            python3 -m pytest -q -rs tests/engine/test_pack_cuda.py tests/engine/test_gather_scatter.py 2>&1 | tail -n 15 ;;
        single|single-coalesced|single-pack)  # MODES overrides the modes measured beside naive and ceiling
            modes=${MODES:-coalesced pack}
            [ "$stage" = single-coalesced ] && modes=coalesced
            [ "$stage" = single-pack ] && modes=pack
            for mode in $modes; do
                bench "single_397b_p1d1_$mode" $BIG --prefill-tp 1 --decode-tp 1 --mode "$mode"
                bench "single_397b_p2d8_$mode" $BIG --prefill-tp 2 --decode-tp 8 --mode "$mode"
                bench "single_08b_p1d1_$mode" $SMALL --prefill-tp 1 --decode-tp 1 --mode "$mode"
            done ;;
        single-p2d8) bench single_397b_p2d8_coalesced $BIG --prefill-tp 2 --decode-tp 8 --mode coalesced ;;
        cross)
            for mode in coalesced pack; do
                bench "cross_397b_p1d1_$mode" $BIG --prefill-tp 1 --decode-tp 1 --mode "$mode" \
                    --prefill-gpus 0 --decode-gpus 1
                bench "cross_397b_p2d8_$mode" $BIG --prefill-tp 2 --decode-tp 8 --mode "$mode" \
                    --prefill-gpus 0 --decode-gpus 1
            done ;;
        split) say "python3 benchmarks/pack_split.py --device cuda --runs 7"
            python3 benchmarks/pack_split.py --device cuda --runs 7 2>&1 | tail -n 20 ;;
        overhead)  # the consumer's own Python work per direct request, NIXL's calls timed apart
            for case in p1d1 p2d8; do
                say "python3 benchmarks/request_overhead.py --device cuda --case $case"
                python3 benchmarks/request_overhead.py --device cuda --case $case 2>&1 | tail -n 3
            done ;;
        threads)  # UCX thread-pool settings against direct-path GB/s (EngineConfig's GPU defaults)
            say "python3 benchmarks/ucx_threads.py --device cuda --case p1d1 --frag 0,1 --json $OUT/ucx_threads_p1d1.json"
            python3 benchmarks/ucx_threads.py --device cuda --case p1d1 --frag 0,1 --json "$OUT/ucx_threads_p1d1.json" 2>&1 \
                | grep -E '^p1d1' ;;
        threads-bench)  # the direct rows again with other UCX thread-pool settings (THREADS="T:S ...")
            for ts in ${THREADS:-0:1 8:16}; do
                t=${ts%%:*}; sp=${ts##*:}
                SWEEP="--fragmentation 1" bench "threads_${t}_${sp}_397b_p2d8" $BIG --prefill-tp 2 --decode-tp 8 \
                    --mode coalesced --backend-threads "$t" --split-batch-size "$sp"
                bench "threads_${t}_${sp}_397b_p1d1" $BIG --prefill-tp 1 --decode-tp 1 --mode coalesced \
                    --backend-threads "$t" --split-batch-size "$sp"
            done ;;
        direct)  # issue 13's rows: the direct path (and pack for P2 -> D8) beside naive, the ceiling and the copy
            bench direct_397b_p1d1_coalesced $BIG --prefill-tp 1 --decode-tp 1 --mode coalesced
            SWEEP="--fragmentation 1" bench direct_397b_p2d8_coalesced $BIG --prefill-tp 2 --decode-tp 8 --mode coalesced
            SWEEP="--fragmentation 1" bench direct_397b_p2d8_pack $BIG --prefill-tp 2 --decode-tp 8 --mode pack ;;
        long)  # issue 13's long-context row (P2 -> D8 at 131,072 tokens, fragmented) and the token sweep
            SWEEP="--fragmentation 1" bench "long_397b_p2d8_131k_$LONG_MODE" $LONG --tokens 131072 \
                --prefill-tp 2 --decode-tp 8 --mode "$LONG_MODE"
            SWEEP="--fragmentation 1 --sweep tokens --sweep-values ${LONG_TOKENS:-8192,32768,131072}" \
                bench "long_397b_p2d8_sweep_tokens_$LONG_MODE" $LONG --prefill-tp 2 --decode-tp 8 --mode "$LONG_MODE" \
                --plot "$OUT/long_397b_p2d8_sweep_tokens_$LONG_MODE.png" ;;
        two-gpu)  # issue 22's two-H200 rows: prefill ranks on GPU 0, decode ranks on GPU 1, the step-batched path
            # (16 requests per step), 3 rounds, verified, --wide for the time split per row. TWO_GPUS="0 1" by default;
            # TWO_GPUS="0 0" runs the same rows on one H200 (issue 22 without the nvidia-h200-x2 kind).
            set -- ${TWO_GPUS:-0 1}; pg=$1; dg=$2
            STEP16="--preset qwen3.5-397b-a17b --tokens 8192 --concurrency 16 --per-step 16 --rounds ${ROUNDS:-3}"
            GPUS="--prefill-gpus $pg --decode-gpus $dg --wide"; TAIL=70
            SWEEP="--sweep fragmentation --sweep-values 0,1" bench "two_p1d1_step16_auto_${pg}${dg}" $STEP16 --requests 32 \
                --prefill-tp 1 --decode-tp 1 --mode auto $GPUS
            SWEEP="--fragmentation 1" bench "two_p2d8_step16_auto_${pg}${dg}" $STEP16 --requests 16 --prefill-tp 2 \
                --decode-tp 8 --mode auto $GPUS
            SWEEP="" bench "two_p1d1_step16_vllm_pool_${pg}${dg}" $STEP16 --requests 32 --prefill-tp 1 --decode-tp 1 \
                --mode auto --allocation vllm-pool $GPUS ;;
        issue20|issue20a|issue20b)  # issue 20's goal rows on one H200 (qwen3.5-397b-a17b, 8,192 tokens, 3 rounds, --verify)
            # issue20a: P1 -> D1 with 16 requests per step (auto, auto with the posting thread, pack; frag 0 and 1),
            # post->DONE at concurrency 1. issue20b: --allocation vllm-pool, P2 -> D8 frag 1 with pack and auto,
            # 131,072 tokens P2 -> D8 auto, and the worker thread per request with 16 requests per step spread
            # over 8 producer engines (benchmarks/request_overhead.py --engines 8; a bench run has one producer
            # engine). issue20 runs both. Each command gets what is left of I20_BUDGET_S (default 560 s per
            # sub-stage, one device call each); a row that would start past it is skipped and named.
            STEP16="--preset qwen3.5-397b-a17b --tokens 8192 --concurrency 16 --per-step 16 --rounds ${ROUNDS:-3}"
            i20() {  # name, args...: one goal row within the sub-stage's budget
                local left=$((i20_end - SECONDS))
                if [ "$left" -lt 30 ]; then echo "=== skipped $1: the stage's ${I20_BUDGET_S:-560} s are spent"; return; fi
                HT_TIMEOUT=$left bench "$@"
            }
            if [ "$stage" != issue20b ]; then
                i20_end=$((SECONDS + ${I20_BUDGET_S:-560}))
                for pt in off on; do
                    SWEEP="--sweep fragmentation --sweep-values 0,1" i20 "issue20_p1d1_step16_auto_post_$pt" $STEP16 \
                        --requests 32 --prefill-tp 1 --decode-tp 1 --mode auto --post-thread "$pt"
                done
                SWEEP="--sweep fragmentation --sweep-values 0,1" i20 issue20_p1d1_step16_pack $STEP16 --requests 32 \
                    --prefill-tp 1 --decode-tp 1 --mode pack
                SWEEP="--fragmentation 1" i20 issue20_p1d1_conc1_auto --preset qwen3.5-397b-a17b --tokens 8192 \
                    --concurrency 1 --per-step 1 --requests 16 --rounds "${ROUNDS:-3}" --prefill-tp 1 --decode-tp 1 --mode auto
            fi
            if [ "$stage" != issue20a ]; then
                i20_end=$((SECONDS + ${I20_BUDGET_S:-560}))
                SWEEP="" i20 issue20_p1d1_step16_vllm_pool $STEP16 --requests 32 --prefill-tp 1 --decode-tp 1 --mode auto \
                    --allocation vllm-pool
                for mode in pack auto; do
                    SWEEP="--fragmentation 1" i20 "issue20_p2d8_step16_$mode" $STEP16 --requests 16 --prefill-tp 2 \
                        --decode-tp 8 --mode "$mode"
                done
                SWEEP="--fragmentation 1" i20 issue20_long_p2d8_131k_auto $LONG --tokens 131072 --prefill-tp 2 \
                    --decode-tp 8 --mode auto
                for engines in 1 8; do
                    say "python3 benchmarks/request_overhead.py --device cuda --case p1d1 --batch 16 --reps 3 --engines $engines"
                    [ -n "${DRY_RUN:-}" ] && continue
                    left=$((i20_end - SECONDS)); [ "$left" -lt 30 ] && { echo "=== skipped engines $engines"; continue; }
                    timeout "$left" python3 benchmarks/request_overhead.py --device cuda --case p1d1 --batch 16 --reps 3 \
                        --engines "$engines" 2>&1 | tail -n 6
                done
            fi ;;
        issue28-p1d1)  # issue28a's first row only (P1->D1 16 per step, frag 0 and 1): a check of one change
            bench issue28_p1d1_step16 --preset qwen3.5-397b-a17b --tokens 8192 --per-step 16 --rounds ${ROUNDS:-3} \
                --read-transport mapped --concurrency "${I28_CONC:-32}" --requests 48 --prefill-tp 1 --decode-tp 1 \
                --mode coalesced ;;
        copier28) say "python3 benchmarks/copier_calls.py"  # each call inside RangeCopier.copy, and both table paths
            [ -n "${DRY_RUN:-}" ] || python3 benchmarks/copier_calls.py 2>&1 | tail -n 30 ;;
        mapped-pytest) say "python3 -m pytest -q -rs -x tests/gpu tests/engine/test_mapped_units.py"
            python3 -m pytest -q -rs -x tests/gpu tests/engine/test_mapped_units.py 2>&1 | tail -n 25 ;;
        issue28|issue28a|issue28b)  # issue 28's rows on one H200: the mapped path beside NIXL and the ceiling, 3 rounds, verified
            # issue28a: the CUDA tests, P1->D1 16 per step (frag 0 and 1; the hook column is the worker thread per
            # request; I28_CONC requests in flight, 32 by default, so one step's start_reads overlaps the previous
            # step's copy as a decode worker's loads do) and concurrency 1 (post->DONE p50). issue28b: P2->D8 frag 1
            # against pack (16 per step; 8 when 16 does not fit), and 131,072 tokens P2->D8.
            STEP16="--preset qwen3.5-397b-a17b --tokens 8192 --per-step 16 --rounds ${ROUNDS:-3} --read-transport mapped"
            TAIL=60
            if [ "$stage" != issue28b ]; then
                say "python3 -m pytest -q -rs -x tests/gpu tests/engine/test_mapped_units.py"
                [ -z "${DRY_RUN:-}" ] && python3 -m pytest -q -rs -x tests/gpu tests/engine/test_mapped_units.py 2>&1 | tail -n 6
                SWEEP="--sweep fragmentation --sweep-values 0,1" bench issue28_p1d1_step16 $STEP16 \
                    --concurrency "${I28_CONC:-32}" --requests 48 --prefill-tp 1 --decode-tp 1 --mode coalesced --wide
                # The same with 64 requests (4 steps a window, 108.7 GiB with --verify; 80 do not fit one H200): the
                # window's first start_reads overlaps no copy, and a longer window pays it over more steps (it did
                # not raise the row: docs/benchmarks.md#issue-28-fourth).
                SWEEP="--fragmentation 0" bench issue28_p1d1_step16_64 $STEP16 \
                    --concurrency "${I28_CONC:-32}" --requests 64 --prefill-tp 1 --decode-tp 1 --mode coalesced --wide
                SWEEP="--fragmentation 1" bench issue28_p1d1_conc1 --preset qwen3.5-397b-a17b --tokens 8192 \
                    --concurrency 1 --per-step 1 --requests 16 --rounds "${ROUNDS:-3}" --read-transport mapped \
                    --prefill-tp 1 --decode-tp 1 --mode coalesced --wide
            fi
            if [ "$stage" != issue28a ]; then
                SWEEP="--fragmentation 1" bench issue28_p2d8_step16 $STEP16 --concurrency 16 --requests 16 \
                    --prefill-tp 2 --decode-tp 8 --mode pack --wide \
                || SWEEP="--fragmentation 1" bench issue28_p2d8_step8 --preset qwen3.5-397b-a17b --tokens 8192 \
                    --per-step 8 --concurrency 8 --requests 8 --rounds "${ROUNDS:-3}" --read-transport mapped \
                    --prefill-tp 2 --decode-tp 8 --mode pack --wide
                SWEEP="--fragmentation 1" bench issue28_long_p2d8_131k $LONG --tokens 131072 --prefill-tp 2 \
                    --decode-tp 8 --mode auto --read-transport mapped --wide
            fi ;;
        profile28)  # where the decode worker's time goes on the mapped path: one request, then 16 per step
            # (benchmarks/request_overhead.py, unprofiled then under cProfile; whole profiles in $OUT for pstats)
            for batch in 1 16; do
                reps=$([ "$batch" = 1 ] && echo 30 || echo 10)
                say "python3 benchmarks/request_overhead.py --device cuda --case p1d1 --batch $batch --reps $reps --read-transport mapped"
                [ -n "${DRY_RUN:-}" ] && continue
                python3 benchmarks/request_overhead.py --device cuda --case p1d1 --batch "$batch" --reps "$reps" \
                    --read-transport mapped 2>&1 | tail -n 6
                HT_OVERHEAD_PROFILE_OUT="$OUT/profile_b$batch" python3 benchmarks/request_overhead.py --device cuda \
                    --case p1d1 --batch "$batch" --reps "$reps" --read-transport mapped --profile \
                    > "$OUT/profile_b$batch.log" 2>&1
                tail -n 6 "$OUT/profile_b$batch.log"
            done
            TAIL=60 SWEEP="--fragmentation 1" bench profile28_p1d1_conc1 --preset qwen3.5-397b-a17b --tokens 8192 \
                --concurrency 1 --per-step 1 --requests 16 --rounds "${ROUNDS:-3}" --read-transport mapped \
                --prefill-tp 1 --decode-tp 1 --mode coalesced --wide ;;
        profile28b)  # the issue28a bench rows with every decode window under cProfile (hybrid_transfer/bench/worker.py:
            # HT_BENCH_PROFILE), one round: the profiles and the garbage collector's passes, packed in one archive
            [ -z "${DRY_RUN:-}" ] && { rm -rf /tmp/bench_profiles; mkdir -p /tmp/bench_profiles; }
            STEP16="--preset qwen3.5-397b-a17b --tokens 8192 --per-step 16 --rounds 1 --read-transport mapped"
            TAIL=12 HT_BENCH_PROFILE=/tmp/bench_profiles/step16 SWEEP="--sweep fragmentation --sweep-values 0,1" \
                bench profile28_p1d1_step16 $STEP16 --concurrency 32 --requests 48 --prefill-tp 1 --decode-tp 1 \
                --mode coalesced --wide
            TAIL=12 HT_BENCH_PROFILE=/tmp/bench_profiles/conc1 SWEEP="--fragmentation 1" bench profile28b_p1d1_conc1 \
                --preset qwen3.5-397b-a17b --tokens 8192 --concurrency 1 --per-step 1 --requests 16 --rounds 1 \
                --read-transport mapped --prefill-tp 1 --decode-tp 1 --mode coalesced --wide
            if [ -z "${DRY_RUN:-}" ]; then tar -C /tmp -czf "$OUT/bench_profiles.tgz" bench_profiles; fi ;;
        *) echo "unknown stage $stage"; exit 2 ;;
    esac
done
