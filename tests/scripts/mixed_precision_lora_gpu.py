"""GPU check of --enable_mixed_precision_lora (Mixed Precision ZeRO++): step 3 with a LoRA actor at ZeRO-3 in fp16,
frozen weights stored in int8, generating through the hybrid engine. DeepSpeed's quantizer is a CUDA op, so this runs
on a GPU only (the CPU tests check the config and the flag's requirements).

The model is a Llama shape with 1024-wide layers: DeepSpeed leaves weights of 500k elements or fewer unquantized,
which would be every weight of the tiny presets.

Usage: python tests/scripts/mixed_precision_lora_gpu.py OUT_DIR   (exits non-zero when the check fails)
"""
import contextlib
import io
import json
import math
import re
import sys
from pathlib import Path

import torch

from dschat.steps import ppo
from dschat.tiny.presets import _special_ids
from dschat.tiny import load_tiny_tokenizer


def build_model(folder):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(hidden_size=1024, intermediate_size=2048, num_hidden_layers=2, num_attention_heads=8,
                         num_key_value_heads=4, max_position_embeddings=512, tie_word_embeddings=False,
                         **_special_ids())
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    load_tiny_tokenizer().save_pretrained(folder)
    return str(folder)


def run_step3(model, out, mixed_precision_lora):
    argv = ["--actor_model_name_or_path", model, "--critic_model_name_or_path", model, "--data_path", "tiny",
            "--data_split", "4,4,2", "--data_output_path", str(out / "data"), "--max_prompt_seq_len", "48",
            "--max_answer_seq_len", "32", "--per_device_generation_batch_size", "8",
            "--per_device_training_batch_size", "8", "--max_steps", "3", "--actor_lora_dim", "8",
            "--actor_zero_stage", "3", "--critic_zero_stage", "3", "--dtype", "fp16",
            "--enable_hybrid_engine", "--eval_prompts", "16", "--output_dir", str(out / "ppo"),
            "--num_warmup_steps", "0", "--reward_model_weight", "0", "--reward_fn", "tiny"]  # no trained reward model
    if mixed_precision_lora:
        argv.append("--enable_mixed_precision_lora")
    captured = io.StringIO()
    torch.cuda.reset_peak_memory_stats()
    with contextlib.redirect_stdout(captured):
        metrics = ppo.main(argv)
    text = captured.getvalue()
    print(text[-3000:])
    quantized = re.search(r"mixed precision LoRA: (\d+) frozen weights stored in int8", text)
    return {"quantized_weights": int(quantized.group(1)) if quantized else 0, "iterations": metrics["iterations"],
            "eval_after": metrics["eval_after"], "peak_gb": torch.cuda.max_memory_allocated() / 1e9}


def main():
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/mixed_precision_lora")
    model = build_model(out / "model")
    result = run_step3(model, out, mixed_precision_lora=True)
    print(json.dumps(result, indent=1, default=str))
    (out / "mixed_precision_lora.json").write_text(json.dumps(result, indent=1, default=str))
    scores = [v for v in (result["eval_after"] or {}).values() if isinstance(v, (int, float))]
    ok = result["quantized_weights"] > 0 and result["iterations"] == 3 and all(math.isfinite(v) for v in scores)
    print("mixed precision LoRA check:", "OK" if ok else "FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
