"""GPU check of --enable_mixed_precision_lora (Mixed Precision ZeRO++): step 3 with a LoRA actor at ZeRO-3 in fp16,
frozen weights stored in int8, generating through the hybrid engine. DeepSpeed's quantizer is a CUDA op, so this runs
on a GPU only (the CPU tests check the config and the flag's requirements).

Then the saved actor: ``from_pretrained`` must load the trained model, LoRA merged into the int8-stored weights as
they were dequantized in training, and answer as the engine did (nothing else saves a model whose frozen weights are
stored quantized).

The model is a Llama shape with 1024-wide layers: DeepSpeed leaves weights of 500k elements or fewer unquantized,
which would be every weight of the tiny presets.

Usage: python tests/scripts/mixed_precision_lora_gpu.py OUT_DIR   (exits non-zero when the check fails)
DeepSpeed 0.19 builds its quantizer for TORCH_CUDA_ARCH_LIST and fails on an entry like 9.0a ("invalid literal for
int()"); on the device machine, where it did, give TORCH_CUDA_ARCH_LIST=9.0.
"""
import argparse
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


PROBE = torch.tensor([[5, 17, 40, 3, 99, 23, 61, 8, 12, 77, 31, 4]])


def trained_reference(trainer):
    """What the trained actor is, read from its engine before the save: the logits of ``PROBE`` (ZeRO-3's forward,
    int8 frozen weights dequantized in it), and each weight merged here by PEFT's formula (``W + scaling * B @ A``)."""
    import deepspeed

    module = trainer.actor_model.module
    module.eval()
    with torch.no_grad():
        logits = module(input_ids=PROBE.to(torch.cuda.current_device())).logits.float().cpu()
    merged = {}
    for name, layer in module.named_modules():
        if not hasattr(layer, "lora_A") or "default" not in layer.lora_A:
            continue
        weights = [layer.base_layer.weight, layer.lora_A["default"].weight, layer.lora_B["default"].weight]
        with deepspeed.zero.GatheredParameters(weights):
            base, a, b = (w.detach().float().cpu().clone() for w in weights)
        plain = name.removeprefix("base_model.model.") + ".weight"
        merged[plain] = (base, base + layer.scaling["default"] * (b @ a))
    return {"logits": logits, "merged": merged}


def check_saved_actor(folder, reference):
    """The saved actor loaded with ``from_pretrained`` against ``reference`` (``trained_reference``): problems, listed."""
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(folder).cuda().eval()
    problems, moved = [], 0
    state = loaded.state_dict()
    dtypes = {str(t.dtype) for t in state.values() if t.is_floating_point()}
    if dtypes != {"torch.float16"}:
        problems.append(f"saved in {dtypes}, not the training dtype float16")
    for name, (base, merged) in reference["merged"].items():
        saved = state[name].float().cpu()
        if not torch.allclose(saved, merged, rtol=1e-3, atol=1e-6):  # (rounded once to fp16: within one unit)
            problems.append(f"{name}: saved differs from the merged trained weight by "
                            f"{(saved - merged).abs().max().item():.3g}")
        moved += not torch.equal(saved, base.half().float())
    if not reference["merged"]:
        problems.append("no LoRA layer found in the engine")
    elif not moved:
        problems.append("no saved weight differs from its base weight: the LoRA deltas were not merged")
    with torch.no_grad():
        logits = loaded(input_ids=PROBE.cuda()).logits.float().cpu()
    gap = (logits - reference["logits"]).abs().max().item()
    scale = reference["logits"].abs().max().item()
    if not gap <= 0.02 * scale:
        problems.append(f"the loaded model's logits differ from the engine's by {gap:.3g} (largest logit {scale:.3g})")
    print(f"saved actor: {len(reference['merged'])} merged weights, {moved} moved by LoRA, logits gap {gap:.3g} "
          f"(largest {scale:.3g})")
    return problems


class _Tee(io.StringIO):
    """Step 3's output kept for the checks below and shown as it comes: a run cut off by a time limit says where."""

    def __init__(self, shown):
        super().__init__()
        self.shown = shown

    def write(self, text):
        self.shown.write(text)
        self.shown.flush()
        return super().write(text)


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
    captured, reference = _Tee(sys.stdout), {}
    save_models = ppo.save_models

    def save_after_reading(trainer, args):
        reference.update(trained_reference(trainer))
        save_models(trainer, args)

    torch.cuda.reset_peak_memory_stats()
    ppo.save_models = save_after_reading
    try:
        with contextlib.redirect_stdout(captured):
            metrics = ppo.main(argv)
    finally:
        ppo.save_models = save_models
    text = captured.getvalue()
    quantized = re.search(r"mixed precision LoRA: (\d+) frozen weights stored in int8", text)
    return {"quantized_weights": int(quantized.group(1)) if quantized else 0, "iterations": metrics["iterations"],
            "eval_after": metrics["eval_after"], "peak_gb": torch.cuda.max_memory_allocated() / 1e9,
            "saved_actor_problems": check_saved_actor(str(out / "ppo" / "actor"), reference)}


def main():
    # (--help was taken for OUT_DIR: the check wrote its model into a folder named --help, then ran)
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("out_dir", nargs="?", default="/tmp/mixed_precision_lora", help="where the model and step 3 write")
    out = Path(p.parse_args().out_dir)
    model = build_model(out / "model")
    result = run_step3(model, out, mixed_precision_lora=True)
    print(json.dumps(result, indent=1, default=str))
    (out / "mixed_precision_lora.json").write_text(json.dumps(result, indent=1, default=str))
    scores = [v for v in (result["eval_after"] or {}).values() if isinstance(v, (int, float))]
    ok = (result["quantized_weights"] > 0 and result["iterations"] == 3 and all(math.isfinite(v) for v in scores)
          and not result["saved_actor_problems"])
    print("mixed precision LoRA check:", "OK" if ok else "FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
