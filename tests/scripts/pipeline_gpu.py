"""The README's commands end to end on an accelerator: ``train.py`` (steps 1-3 through DeepSpeed) as a user runs it.

The CPU tests run every step on tiny models; this script runs what they cannot: DeepSpeed's CUDA path (its JIT-built
optimizers, bf16), the hybrid engine's CUDA graphs inside step 3, and real model shapes, from the same commands a user
types. No hub is needed: the real shapes are random models written with the embedded tiny tokenizer.

    python tests/scripts/pipeline_gpu.py --out /tmp/pipeline            # every case below
    python tests/scripts/pipeline_gpu.py --cases tiny,opt --out DIR    # some of them

Cases:
- ``tiny``: ``python train.py`` (the README's first command, the embedded tiny default).
- ``opt``: ``python train.py --actor-model <OPT-1.3B shape> --reward-model <OPT-350m shape> --deployment-type
  single_gpu --data-path tiny`` with a few optimizer steps per step, step 3 with the hybrid engine.
- ``qwen_z3``: ``deepspeed --num_gpus 1 train.py`` with a Qwen2.5-0.5B-shaped actor and reward model (grouped-query
  attention), ZeRO-3 for both, step 3 with the hybrid engine and LoRA.
- ``grpo``: ``python train.py --recipe grpo`` on the OPT-1.3B shape (step 1, then GRPO rewarded by the bundled rule
  scorer of the tiny data).
- ``dpo``: ``python train.py --recipe dpo`` on the OPT-1.3B shape (step 1, then DPO).
- ``ready_rm`` (after ``opt``): ``python train.py --step 1 3 --reward-model OUT/opt/step2_rm`` on the OPT-1.3B shape:
  step 3 scores with a reward model trained before and starts its critic from it, the first iteration training the
  critic alone (``--freezing_actor_steps 1``).
- ``grpo_rm`` (after ``opt``): ``python train.py --recipe grpo --reward-model OUT/opt/step2_rm``: GRPO rewarded by
  that reward model instead of the rule scorer.
- ``hub_rm``: ``python train.py --step 1 3 --reward-model acme/opt-350m-rm``, a hub name of a one-label
  OPTForSequenceClassification (OPT-350m shape; TRL's layout) in a hub cache written here (HF_HUB_CACHE; offline).
Each case's log is written to OUT/<case>.log; a table of exit codes, seconds and the reports' metrics is printed, and
the policy each case saved (its report's ``policy``) is loaded with ``from_pretrained`` and asked for a greedy answer. Exits non-zero if a case
fails.
"""
import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]

OPT_ACTOR = dict(vocab_size=50272, hidden_size=2048, num_hidden_layers=24, ffn_dim=8192, num_attention_heads=32,
                 max_position_embeddings=2048, word_embed_proj_dim=2048, do_layer_norm_before=True)
OPT_REWARD = dict(vocab_size=50272, hidden_size=1024, num_hidden_layers=24, ffn_dim=4096, num_attention_heads=16,
                  max_position_embeddings=2048, word_embed_proj_dim=512, do_layer_norm_before=False)
QWEN = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
            num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0, tie_word_embeddings=True)

FEW_STEPS = "--max_steps 20 --per_device_train_batch_size 8 --per_device_eval_batch_size 8 --eval_iters 4"
CASES = ("tiny", "opt", "qwen_z3", "grpo", "dpo", "ready_rm", "grpo_rm", "hub_rm")
HUB_REWARD_MODEL = "acme/opt-350m-rm"
STEP3 = ("--max_steps 3 --per_device_generation_batch_size 8 --per_device_training_batch_size 8 "
         "--max_prompt_seq_len 128 --max_answer_seq_len 64 --enable_hybrid_engine --eval_prompts 32")


def save_random_model(folder, config_class, shape, model_class=None):
    from transformers import AutoModelForCausalLM

    from dschat.tiny import load_tiny_tokenizer

    torch.manual_seed(0)
    tokenizer = load_tiny_tokenizer()
    config = config_class(**shape, **({"num_labels": 1, "pad_token_id": tokenizer.pad_token_id} if model_class else {}))
    model = model_class(config).to(torch.bfloat16) if model_class else AutoModelForCausalLM.from_config(
        config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def save_to_hub_cache(cache, name, save):
    """``save(folder)`` into the snapshot of hub model ``name`` in the hub cache ``cache``, as a download leaves it."""
    repo = cache / f"models--{name.replace('/', '--')}"
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    save(repo / "snapshots" / commit)


SMOKE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=1024)


def shape(base, smoke):
    """``base``, or with --smoke a 2-layer model of the same family that runs on the CPU."""
    if not smoke:
        return base
    small = dict(base, **SMOKE)
    for key, value in (("ffn_dim", 128), ("word_embed_proj_dim", 64), ("intermediate_size", 128),
                       ("num_key_value_heads", 2)):
        if key in small:
            small[key] = value
    return small


def cases(out, wanted, smoke=False):
    """(name, command) of each wanted case; the random models are written on the way."""
    from transformers import OPTConfig, Qwen2Config

    models = out / "models"
    if "tiny" in wanted:
        yield "tiny", [sys.executable, "train.py", "--output-dir", str(out / "tiny")]
    if "opt" in wanted:
        actor = save_random_model(models / "opt-1.3b-shape", OPTConfig, shape(OPT_ACTOR, smoke))
        reward = save_random_model(models / "opt-350m-shape", OPTConfig, shape(OPT_REWARD, smoke))
        yield "opt", [sys.executable, "train.py", "--actor-model", str(actor), "--reward-model", str(reward),
                      "--deployment-type", "single_gpu", "--data-path", "tiny", "--output-dir", str(out / "opt"),
                      "--step1-args", FEW_STEPS, "--step2-args", FEW_STEPS, "--step3-args", STEP3]
    if "qwen_z3" in wanted:
        qwen = save_random_model(models / "qwen2.5-0.5b-shape", Qwen2Config, shape(QWEN, smoke))
        yield "qwen_z3", ["deepspeed", "--num_gpus", "1", "train.py", "--actor-model", str(qwen), "--reward-model",
                          str(qwen), "--deployment-type", "single_gpu", "--actor-zero-stage", "3",
                          "--reward-zero-stage", "3", "--data-path", "tiny", "--output-dir", str(out / "qwen_z3"),
                          "--step1-args", FEW_STEPS, "--step2-args", FEW_STEPS,
                          "--step3-args", STEP3 + " --actor_lora_dim 16"]
    if {"grpo", "dpo", "ready_rm", "grpo_rm", "hub_rm"} & set(wanted):
        actor = save_random_model(models / "opt-1.3b-shape", OPTConfig, shape(OPT_ACTOR, smoke))
    for recipe in ("grpo", "dpo"):
        if recipe in wanted:
            yield recipe, [sys.executable, "train.py", "--recipe", recipe, "--actor-model", str(actor),
                           "--deployment-type", "single_gpu", "--data-path", "tiny", "--output-dir", str(out / recipe),
                           "--step1-args", FEW_STEPS, "--step2-args", FEW_STEPS, "--step3-args", STEP3]
    if "ready_rm" in wanted:
        yield "ready_rm", [sys.executable, "train.py", "--step", "1", "3", "--actor-model", str(actor),
                           "--reward-model", str(out / "opt" / "step2_rm"), "--deployment-type", "single_gpu",
                           "--data-path", "tiny", "--output-dir", str(out / "ready_rm"), "--step1-args", FEW_STEPS,
                           "--step3-args", STEP3 + " --freezing_actor_steps 1"]
    if "grpo_rm" in wanted:
        yield "grpo_rm", [sys.executable, "train.py", "--recipe", "grpo", "--actor-model", str(actor),
                          "--reward-model", str(out / "opt" / "step2_rm"), "--deployment-type", "single_gpu",
                          "--data-path", "tiny", "--output-dir", str(out / "grpo_rm"), "--step1-args", FEW_STEPS,
                          "--step3-args", STEP3]
    if "hub_rm" in wanted:
        from transformers import OPTForSequenceClassification

        save_to_hub_cache(Path(os.environ["HF_HUB_CACHE"]), HUB_REWARD_MODEL, lambda folder: save_random_model(
            folder, OPTConfig, shape(OPT_REWARD, smoke), OPTForSequenceClassification))
        yield "hub_rm", [sys.executable, "train.py", "--step", "1", "3", "--actor-model", str(actor),
                         "--reward-model", HUB_REWARD_MODEL, "--deployment-type", "single_gpu", "--data-path", "tiny",
                         "--output-dir", str(out / "hub_rm"), "--step1-args", FEW_STEPS, "--step3-args", STEP3]


def answer_of(actor_folder):
    """A greedy answer of the saved actor, loaded as a user would."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(actor_folder)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(actor_folder, dtype=torch.bfloat16).to(device).eval()
    ids = tokenizer("Human: Name three colors.\nAssistant:", return_tensors="pt").to(device)
    out = model.generate(**ids, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)


def run_case(name, command, out):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    log = out / f"{name}.log"
    started = time.time()
    with open(log, "w") as f:
        f.write("+ " + " ".join(command) + "\n")
        f.flush()
        rc = subprocess.run(command, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    seconds = time.time() - started
    report_path = out / name / "report.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else None
    policy = out / name / report["policy"] if report and report.get("policy") else None
    answer = None
    if rc == 0 and policy is not None and policy.is_dir():
        try:
            answer = answer_of(policy)
        except Exception as error:  # noqa: BLE001 - reported in the table
            answer = f"LOAD FAILED: {type(error).__name__}: {error}"
    return {"case": name, "rc": rc, "seconds": round(seconds, 1), "report": report, "answer": answer,
            "log_tail": log.read_text()[-3000:] if rc else None}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/pipeline_gpu")))
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--smoke", action="store_true", help="2-layer models of the same families: checks the "
                        "script and its commands on the CPU")
    args = parser.parse_args()
    wanted = args.cases.split(",")
    unknown = set(wanted) - set(CASES)
    if unknown:  # (before --out is made: a typo left an empty folder)
        parser.error(f"unknown cases {sorted(unknown)} (cases: {', '.join(CASES)})")
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.update(HF_HUB_CACHE=str(args.out / "hub_cache"), HF_HUB_OFFLINE="1")  # (hub_rm's; the cases' env)
    results = []
    for name, command in cases(args.out, wanted, args.smoke):
        result = run_case(name, command, args.out)
        results.append(result)
        print(json.dumps({k: v for k, v in result.items() if k != "log_tail"}, default=str), flush=True)
        if result["log_tail"]:
            print(result["log_tail"], flush=True)
    (args.out / "pipeline_gpu.json").write_text(json.dumps(results, indent=1, default=str))
    print("\n| case | exit | seconds | answer of the saved policy |\n|---|---|---|---|")
    for r in results:
        print(f"| {r['case']} | {r['rc']} | {r['seconds']} | {r['answer']!r} |")
    failed = [r["case"] for r in results if r["rc"] != 0 or r["answer"] is None or r["answer"].startswith("LOAD FAILED")]
    if failed:
        print(f"FAILED: {failed}")
        sys.exit(1)


if __name__ == "__main__":
    main()
