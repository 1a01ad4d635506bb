#!/usr/bin/env bash
# The GPU checks a session runs after changes it could test on the CPU only, in device calls of under 10 minutes:
#
#   bash bench/gpu_verify.sh pipeline [CASES]       # train.py end to end: tiny, Qwen ZeRO-3, GRPO (pipeline_gpu.py's)
#   bash bench/gpu_verify.sh equality [FAMILIES]    # HF-API tests (recurrent models, GPT-Neo), graph equality
#   bash bench/gpu_verify.sh speed                  # issue 7's numbers: OPT-1.3B decode ZeRO-0/3, PPO iteration ZeRO-2/3
#   bash bench/gpu_verify.sh named                  # GPU-only tests, the mixed-precision LoRA step 3, graph_equality's
#                                                   # named checks (LoRA, ZeRO-3, step after generation, host syncs),
#                                                   # the first fp16/bf16 optimizer step at ZeRO-0/1/2
#   bash bench/gpu_verify.sh logprob                # decode log-probs against the training forward at T=1 and 0.7
#   bash bench/gpu_verify.sh recurrent [FAMILIES]   # step 3's HF generate of RWKV, RecurrentGemma, DeepSeek-V4 and
#                                                   # xLSTM, rows of one prompt length together, against each row
#                                                   # alone, fp32 and bf16 (recurrent_rows.py)
#
# CASES and FAMILIES are comma-separated subsets (pipeline_gpu.py --cases, graph_equality.py's or recurrent_rows.py's
# --families; a family list runs no named check): for finishing what a call cut short. Session 41's first cold call
# ran the first two parts together and ran out of its limits.
# Run on the device machine from the repository root, with .whl/ carried (bash ../shared/tools/gpu-wheels.sh here
# first). Each check's log and JSON go to $OUT; one check failing does not stop the others; the last lines are a
# table of each check's exit status and seconds. Record the numbers in docs/benchmarks.md with the commit.
set -u
part=${1:?usage: bash bench/gpu_verify.sh pipeline|equality|speed|named|logprob|recurrent [subset]}
subset=${2:-}
out=${OUT:?no \$OUT: run it through the device tool}
[[ $part == pipeline || $part == equality || $part == speed || $part == named || $part == logprob \
   || $part == recurrent ]] \
    || { echo "unknown part $part: pipeline, equality, speed, named, logprob or recurrent" >&2; exit 2; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
export TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TQDM_DISABLE=1
git rev-parse HEAD > "$out/commit.txt" 2>/dev/null || true
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/gpu.txt" 2>&1

# A JIT build of a DeepSpeed op cut off by a limit leaves its lock file, and the next build of it on this (warm)
# machine waits for that lock for ever (torch.utils.cpp_extension's FileBaton): nothing else builds now, so drop them.
find "${TORCH_EXTENSIONS_DIR:-$HOME/.cache/torch_extensions}" -name lock -type f -delete 2>/dev/null

summary=()
check() {  # check NAME LIMIT_S COMMAND...: the command's output in $out/NAME.log
    local name=$1 limit=$2 started status
    shift 2
    started=$(date +%s)
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    status=$?
    summary+=("$(printf '%-28s exit %3d  %4d s' "$name" "$status" $(( $(date +%s) - started )))")
    tail -3 "$out/$name.log"
}

case $part in
pipeline)
    check pipeline 560 python tests/scripts/pipeline_gpu.py --cases "${subset:-tiny,qwen_z3,grpo}" --out "$out/pipe"
    ;;
equality)
    [[ -z $subset ]] && check hf_api_tests 150 python -m pytest tests/test_hybrid_engine_hf_api.py -q
    check graph_equality 400 python bench/graph_equality.py ${subset:+--families "$subset"}
    ;;
speed)
    # (the actor without gradient checkpointing peaks at 86-94 GB: on an 80 GB H100 it runs out of memory (session 48),
    # so there the iteration keeps checkpointing on, as DeepSpeed-Chat's measured run does)
    mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
    ckpt=_nockpt
    (( ${mib:-0} > 0 && mib < 100000 )) && ckpt= && echo "GPU memory ${mib} MiB: the PPO iteration with gradient checkpointing"
    check ppo_iteration 300 python bench/ppo_iteration.py --variants z2_hybrid_genlogp$ckpt,z3_hybrid_genlogp$ckpt \
        --iterations 6 --cuda_graph --left_pad 8 --json ppo_iteration.json
    check generation 240 python bench/generation.py --models opt-1.3b --batches 64 \
        --variants dschat_z0_graph_compiled,dschat_z3_graph_compiled --repeats 3 --json generation.json
    ;;
named)
    # (session 45: these tests passed 4 in the first 100 s, Triton's autotuning included; the mixed-precision LoRA
    # test, which builds DeepSpeed's quantizer op first, was still running at 230 s, so it runs on its own below)
    check gpu_tests 150 python -m pytest -v -rs -k "(gpu or cuda) and not mixed_precision" \
        tests/test_hybrid_engine_sampling.py tests/test_decode_attention.py tests/test_align_overflow.py \
        tests/test_ds_config.py
    check first_step 120 python tests/scripts/first_step_gpu.py  # (ZeRO-0's fp16/bf16 wrappers over FusedAdam)
    check mixed_precision_lora 300 python tests/scripts/mixed_precision_lora_gpu.py /tmp/mixed_precision_lora
    check named_checks 120 python bench/graph_equality.py lora_check zero3_check zero3_step_after_generation host_syncs
    ;;  # (session 45: the named checks took 50 s)
logprob)
    check logprob_delta_t1 60 python bench/logprob_delta.py --cuda_graph
    check logprob_delta_t0.7 60 python bench/logprob_delta.py --cuda_graph --temperature 0.7
    ;;
recurrent)  # (exit 1 only on a crash or an fp32 row unequal to alone: bf16 differences are the table's to record)
    check recurrent_rows 200 python bench/recurrent_rows.py --device cuda ${subset:+--families "$subset"} \
        --json recurrent_rows.json
    ;;
esac
printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"
