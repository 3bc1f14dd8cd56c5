#!/usr/bin/env bash
# One device call that runs the GPU benchmarks in priority order, each under its own time limit, and
# leaves logs and JSON in $OUT (the device tool brings them back). From the repository root, with
# the wheels the device lacks in .whl/ (see /work/.library/device/README.md):
#   bash bench/gpu_session.sh [STEP ...]     (default: tp engine kernels serving spec; one call is <= 600 s,
#                                              so pass a few steps per call)
# Steps: tp, engine (ENGINE_ARGS=--skip-checks: figures only), hfc (P1/P2 with transformers' static cache + torch.compile beside), graphs (CUDA graphs == eager), kernels, serving (P3, P6), spec, profile (extend-step
# cost, P3 step timeline, bs-256 kernel table), p3-thread / ab (scheduler thread vs process), p6, tiles.
# gemv (batch-1 linears: cuBLAS vs kernels/gemv.py), gemvcheck (the engine's bf16 greedy log-probs, GEMV vs cuBLAS), prologue (norm/SiLU folded into the GEMV or not), profile8b / profile06 (kernel table of an 8B / 0.6B batch-1 step), fp8thr (8B-shape offline throughput, nano-vllm recipe at FP8THR_SCALE=0.5, bf16 / --quantization fp8 alternating twice), profilefp8 (the 8B shape's decode kernel table at PROFILEFP8_BATCH=96 rows, bf16 then --quantization fp8),
# fp8kv (--kv-cache-dtype fp8_e4m3 vs bf16, bench/gpu_fp8_kv.py; FP8KV_ARGS=--skip-capacity-run if short of time),
# sweep (decode attention launch shapes), p3diag (P3 through the Engine, with a 400k pool, and the bare loop),
# pipeline (`radixserve up` vs the in-process Engine; needs .whl-pipeline/ carried too: its wheels and tokenizer/),
# fp8 (FP8 kernels: checks, GEMV/GEMM/MoE timings), fp8rows (bench/gpu_fp8_rows.py: the FP8 products' forms and tiles at 64-256 rows), fp8moecheck (bench/gpu_fp8_moe_check.py: where the w8a8 MoE's
# distance from its reference comes from), fp8mma (kernels/fp8_gemv_mma.py: checks, tile sweep, step), fp8res (FP8-resident weights through the Engine, FP8RES_SHAPE=8b|0.6b;
# 8b needs ~330 s; FP8RES_ARGS="--init 0.005 --logprobs-only": the log-prob check alone on a checkpoint at a quarter
# the init range, bench/cpu_fp8_sensitivity.py), pdl (bench/gpu_pdl.py: programmatic dependent launch on/off through the Engine, PDL_ARGS="--models 0.6b"),
# flagchain (bench/gpu_flag_chain.py: a 0.6B-shaped GEMV chain with stream order, the PDL wait, or counters),
# gemvchain (bench/gpu_gemv_chain.py: the 0.6B's narrow o/down products under each GEMV tile, timed in kernels/gemv.py's chain),
# profiledet (the bs-256 decode kernel table and extend probe, with and without --enable-deterministic-inference;
# PROFILEDET_MODES=deterministic for one side, PROFILEDET_ARGS=--host-profile for cProfile tables),
# pipetrace (gpu_pipeline.py with RS_TRACE_DIR set, then bench/pipeline_trace.py: where TTFT goes, stage by stage),
# moestages (bench/gpu_moe_stages.py), q35 / q35check (Qwen3.5 figures / checks; Q35_ARGS="--fp8 --models 35b-a3b --figures decode" for the full FP8 35B-A3B),
# routing (MoE routing and the sorted layout: torch ops vs kernels/moe_routing.py and kernels/moe_blocks.py in CUDA
# graphs, bench/gpu_moe_routing.py),
# deterministic (bench/gpu_deterministic.py; DETERMINISTIC_ARGS picks parts, e.g. --skip-kernels --skip-attention
# --skip-outputs --skip-throughput for part 4 alone, the pipeline, which needs .whl-pipeline/ carried as `pipeline`
# does; --skip-kernels --skip-outputs --skip-pipeline: part 1b, the token-block extend attention, and P3),
# flashinfer (bench/gpu_flashinfer.py; needs .whl-flashinfer/ carried: flashinfer-python 0.6.18 and the dependencies
# it imports, ~38 MB, without nvidia-cutlass-dsl and nvidia-cudnn-frontend, which the paged wrappers do not need).
# The device's copy of the repository has an older .git: never run git there. To run committed code
# while the tree has uncommitted edits: `git archive HEAD | tar -x -C .snap`, copy .whl/ into .snap/,
# carry .snap and `cd .snap` first.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  $(compgen -G '.whl-pipeline/*.whl') $(compgen -G '.whl-flashinfer/*.whl') \
  && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1 OUT="${OUT:-bench/out}"
mkdir -p "$OUT"
nvidia-smi -L
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tp engine kernels serving spec)
for step in "${steps[@]}"; do
  case "$step" in
    tp)      gpus=$(nvidia-smi -L | wc -l)
             [ "$gpus" -ge 2 ] && timeout 570 python bench/gpu_tp.py ${TP_ARGS:-} > "$OUT/tp.log" 2>&1 ;;
    engine)  timeout 450 python bench/gpu_engine.py --models ${ENGINE_MODELS:-0.6b,8b} --skip-hf ${ENGINE_ARGS:-} > "$OUT/engine.log" 2>&1 ;;
    tiles)   timeout 300 python bench/gpu_engine.py --models 8b --skip-checks --skip-hf --decode-tiles 64/4/3,32/4/3 \
               --tokens-per-split 64 > "$OUT/tiles.log" 2>&1 ;;
    ab)      timeout 300 python bench/gpu_engine.py --models 0.6b --skip-checks --skip-hf --also-thread \
               > "$OUT/ab.log" 2>&1 ;;
    p6)      timeout 300 python bench/gpu_serving.py --figures p6 --json gpu_serving_p6.json > "$OUT/p6.log" 2>&1 ;;
    graphs)  timeout 300 python bench/gpu_cuda_graph.py > "$OUT/graphs.log" 2>&1 ;;
    p3-thread) timeout 300 python bench/gpu_serving.py --figures p3 --scheduler-thread --json gpu_serving_thread.json \
               > "$OUT/p3-thread.log" 2>&1 ;;
    kernels) timeout 300 python bench/gpu_kernels.py > "$OUT/kernels.log" 2>&1 ;;
    serving) python -c "import torch; from bench.gpu_common import build_checkpoint; build_checkpoint('0.6b', torch.bfloat16)" \
               && timeout 500 python bench/gpu_serving.py --figures ${FIGURES:-p3,p6} > "$OUT/serving.log" 2>&1 ;;
    hfc)     timeout 500 python bench/gpu_engine.py --models ${HFC_MODELS:-0.6b,8b} --skip-checks --hf-compile > "$OUT/hfc.log" 2>&1 ;;
    profile) python -c "import torch; from bench.gpu_common import build_checkpoint; build_checkpoint('0.6b', torch.bfloat16)" \
               && timeout 300 python bench/gpu_profile_step.py --extend --p3-timeline --batch 256 --prompt 600 \
                  --temperature 0.6 > "$OUT/profile.log" 2>&1 ;;
    spec)    timeout 300 python bench/gpu_spec.py --k ${SPEC_K:-4} --steps 128 ${SPEC_ARGS:-} > "$OUT/spec.log" 2>&1 ;;
    gemv)    timeout 200 python bench/gpu_gemv.py ${GEMV_ARGS:-} > "$OUT/gemv.log" 2>&1 ;;
    prologue) timeout 200 python bench/gpu_gemv_prologue.py > "$OUT/prologue.log" 2>&1 ;;
    gemvcheck) timeout 200 python bench/gpu_gemv_check.py > "$OUT/gemvcheck.log" 2>&1 ;;
    profile8b) python -c "import torch; from bench.gpu_common import build_checkpoint; build_checkpoint('8b', torch.bfloat16)" \
               && timeout 200 python bench/gpu_profile_step.py --model /tmp/rs-qwen3-8b-bfloat16 --batch 1 --prompt 128 \
                  > "$OUT/profile8b.log" 2>&1 ;;
    profilefp8) python -c "import torch; from bench.gpu_common import build_checkpoint; build_checkpoint('8b', torch.bfloat16)" \
               && for q in "" fp8; do timeout 240 python bench/gpu_profile_step.py --model /tmp/rs-qwen3-8b-bfloat16 \
                    --batch ${PROFILEFP8_BATCH:-96} --prompt 512 --temperature 0.6 ${q:+--quantization $q}; done \
                  > "$OUT/profilefp8.log" 2>&1 ;;
    fp8thr)  python -c "import torch; from bench.gpu_common import build_checkpoint; build_checkpoint('8b', torch.bfloat16)" \
               && for i in 1 2; do for q in bf16 fp8; do timeout 200 python bench/gpu_serving.py \
                    --model /tmp/rs-qwen3-8b-bfloat16 --figures p3 --scale ${FP8THR_SCALE:-0.5} \
                    --json "gpu_serving_8b_${q}_$i.json" $([ $q = fp8 ] && echo --quantization fp8); done; done \
                  > "$OUT/fp8thr.log" 2>&1 ;;
    profile06) python -c "import torch; from bench.gpu_common import build_checkpoint; build_checkpoint('0.6b', torch.bfloat16)" \
               && timeout 200 python bench/gpu_profile_step.py --batch 1 --prompt 128 > "$OUT/profile06.log" 2>&1 ;;
    sweep)   timeout 400 python bench/gpu_decode_sweep.py > "$OUT/sweep.log" 2>&1 ;;
    p3diag)  python -c "import torch; from bench.gpu_common import build_checkpoint; build_checkpoint('0.6b', torch.bfloat16)" \
               && { timeout 150 python bench/gpu_serving.py --figures p3 --json gpu_serving_p3.json;
                    timeout 150 python bench/gpu_serving.py --figures p3 --max-total-tokens 400000 --json gpu_serving_p3_400k.json;
                    timeout 150 python bench/gpu_profile_step.py --p3-timeline --batch 0 --temperature 0.6; } > "$OUT/p3diag.log" 2>&1 ;;
    p3spy)   python -c "import torch; from bench.gpu_common import build_checkpoint; build_checkpoint('0.6b', torch.bfloat16)"
             python bench/gpu_serving.py --figures p3 --json gpu_serving_p3spy.json > "$OUT/p3spy.log" 2>&1 & pid=$!
             sleep 1; timeout 150 /tmp/site/bin/py-spy record --pid $pid --subprocesses --nonblocking --idle --rate 100 \
               --format raw -o "$OUT/p3spy.txt" >> "$OUT/p3spy.log" 2>&1; wait $pid ;;
    flashinfer) MAX_JOBS=16 timeout 560 python bench/gpu_flashinfer.py ${FLASHINFER_ARGS:-} > "$OUT/flashinfer.log" 2>&1 ;;
    pipeline) timeout 400 python bench/gpu_pipeline.py ${PIPELINE_ARGS:-} > "$OUT/pipeline.log" 2>&1 ;;
    deterministic) timeout 560 python bench/gpu_deterministic.py ${DETERMINISTIC_ARGS:-} > "$OUT/deterministic.log" 2>&1 ;;
    fp8kv)   python -c "import torch; from bench.gpu_common import build_checkpoint; build_checkpoint('8b', torch.bfloat16, 0.02)" \
               && timeout 540 python bench/gpu_fp8_kv.py ${FP8KV_ARGS:-} > "$OUT/fp8kv.log" 2>&1 ;;
    fp8mma)  timeout 450 python bench/gpu_fp8_mma.py ${FP8MMA_ARGS:-} > "$OUT/fp8mma.log" 2>&1 ;;
    fp8)     timeout 400 python bench/gpu_fp8.py ${FP8_ARGS:---quick} > "$OUT/fp8.log" 2>&1 ;;
    fp8rows) timeout 500 python bench/gpu_fp8_rows.py ${FP8ROWS_ARGS:-} > "$OUT/fp8rows.log" 2>&1 ;;
    fp8res)  timeout 540 python bench/gpu_fp8_resident.py ${FP8RES_SHAPE:-8b} ${FP8RES_ARGS:-} > "$OUT/fp8res.log" 2>&1
             rm -rf /tmp/rs-qwen3-*-fp8 /tmp/rs-qwen3-*-fp8-dequantized ;;  # 24 GB of the 64 GB disk
    q35)     timeout 500 python bench/gpu_qwen35.py ${Q35_ARGS:---models 9b} > "$OUT/q35.log" 2>&1 ;;
    flagchain) timeout 300 python bench/gpu_flag_chain.py ${FLAGCHAIN_ARGS:-} > "$OUT/flagchain.log" 2>&1 ;;
    gemvchain) timeout 200 python bench/gpu_gemv_chain.py ${GEMVCHAIN_ARGS:-} > "$OUT/gemvchain.log" 2>&1 ;;
    pdl)     timeout 560 python bench/gpu_pdl.py ${PDL_ARGS:-} > "$OUT/pdl.log" 2>&1 ;;
    moestages) timeout 200 python bench/gpu_moe_stages.py ${MOESTAGES_ARGS:-} > "$OUT/moestages.log" 2>&1 ;;
    fp8moecheck) timeout 300 python bench/gpu_fp8_moe_check.py ${FP8MOECHECK_ARGS:-} > "$OUT/fp8moecheck.log" 2>&1 ;;
    q35check) timeout 300 python bench/gpu_qwen35_check.py ${Q35CHECK_ARGS:-} > "$OUT/q35check.log" 2>&1 ;;
    routing) timeout 300 python bench/gpu_moe_routing.py > "$OUT/routing.log" 2>&1 ;;
    profiledet) python -c "import torch; from bench.gpu_common import build_checkpoint; build_checkpoint('0.6b', torch.bfloat16)" \
               && for mode in ${PROFILEDET_MODES:-default deterministic}; do flag=; [ "$mode" = deterministic ] && flag=--deterministic
                  timeout 200 python bench/gpu_profile_step.py --extend --batch 256 --prompt 600 --temperature 0.6 $flag \
                  ${PROFILEDET_ARGS:-}; done > "$OUT/profiledet.log" 2>&1 ;;
    pipetrace) rm -rf /tmp/rs-trace && RS_TRACE_DIR=/tmp/rs-trace timeout 400 python bench/gpu_pipeline.py --repeats 1 \
               --floor-runs 4 --text-runs 4 ${PIPETRACE_ARGS:-} --out "$OUT/gpu_pipeline_trace.json" > "$OUT/pipetrace.log" 2>&1 \
               && python bench/pipeline_trace.py /tmp/rs-trace >> "$OUT/pipetrace.log" 2>&1 ;;
    *)       echo "unknown step $step"; continue ;;
  esac
  echo "== $step: exit $?"
  tail -n 15 "$OUT/$step.log" 2>/dev/null
done
