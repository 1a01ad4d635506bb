"""How far the hybrid engine's decode-step log-probabilities (``generate(..., return_logprobs=True)``) are from the
training forward's, as PPO would compute its old log-probs from the generated sequences.

The two differ only by kernels and rounding: the decode step reads a KV cache one token at a time (and, with
``--cuda_graph``, from a captured graph); the training forward runs the whole sequence at once. Prints mean and max
|delta logp| over the answer tokens, and the mean log-prob itself for scale. Random-weight model from a config,
sampled (--temperature, 1 by default), P prompt + G generated tokens, batch B.

    python bench/logprob_delta.py --model opt-1.3b --batch 64 --cuda_graph      # on the GPU (bf16)
    python bench/logprob_delta.py --smoke                                        # tiny fp32 model on the CPU

Writes JSON to $OUT when set.
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from generation import SHAPES, log  # noqa: E402
from results import require_cuda, run_benchmark, temperature_flag, write_json  # noqa: E402


def build_engine(args):
    import deepspeed
    from transformers import AutoModelForCausalLM, Qwen2Config

    from dschat.hybrid_engine import HybridEngine, HybridEngineConfig
    from dschat.utils.dist import ensure_distributed

    ensure_distributed()
    config = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2) if args.smoke else SHAPES[args.model]()
    torch.manual_seed(0)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(config, dtype=args.dtype)
    ds_config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                 "zero_optimization": {"stage": 0}, "steps_per_print": 10**9}
    if args.dtype == torch.bfloat16:
        ds_config["bf16"] = {"enabled": True}
    engine, *_ = deepspeed.initialize(model=model, config=ds_config, dist_init_required=False)
    return HybridEngine(engine, HybridEngineConfig(enabled=True, max_out_tokens=args.prompt + args.gen,
                                                   enable_cuda_graph=args.cuda_graph), pad_token_id=1, eos_token_id=2)


def training_logprobs(engine, seq, prompt_len, chunk_size, temperature):
    """Old log-probs as step 3 computes them: one forward over the whole sequence (answer positions only), under
    softmax(logits / temperature) as step 3 scores a sampled rollout."""
    from dschat.rlhf.layout import LeftAligned
    from dschat.rlhf.trainer import answer_token_stats

    mask = torch.ones_like(seq)
    with torch.no_grad():
        return answer_token_stats(engine, seq, mask, prompt_len - 1, LeftAligned.of(mask), chunk_size,
                                  temperature=temperature)


def main():
    from dschat.args import positive_int  # (sizes of 0 failed deep inside the model or engine)

    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--model", default="opt-1.3b", choices=sorted(SHAPES))
    p.add_argument("--batch", type=positive_int, default=64)
    p.add_argument("--prompt", type=positive_int, default=256)
    p.add_argument("--gen", type=positive_int, default=256)
    p.add_argument("--cuda_graph", action="store_true")
    p.add_argument("--temperature", type=temperature_flag, default=1.0,
                   help="sampling temperature; both sides score at it (step 3's scoring_temperature)")
    p.add_argument("--smoke", action="store_true", help="a tiny fp32 model on the CPU: checks the script only")
    args = p.parse_args()
    if not args.smoke:
        require_cuda("--smoke checks the script on the CPU")
    args.device = "cpu" if args.smoke else "cuda"
    args.dtype = torch.float32 if args.smoke else torch.bfloat16
    if args.smoke:
        args.batch, args.prompt, args.gen = min(args.batch, 4), min(args.prompt, 16), min(args.gen, 16)
    engine = build_engine(args)
    g = torch.Generator(device=args.device).manual_seed(0)
    vocab = engine.module.config.vocab_size
    prompt = torch.randint(4, vocab, (args.batch, args.prompt), device=args.device, generator=g)
    engine.eval()
    seq, decode_logp = engine.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=args.gen,
                                       do_sample=True, temperature=args.temperature, top_k=0, eos_token_id=None,
                                       generator=g, return_logprobs=True)
    engine.train()
    train_logp = training_logprobs(engine, seq, args.prompt, chunk_size=None, temperature=args.temperature)
    delta = (decode_logp - train_logp).abs()
    result = {"model": "smoke" if args.smoke else args.model, "batch": args.batch, "prompt": args.prompt,
              "gen": args.gen, "dtype": str(args.dtype), "cuda_graph": args.cuda_graph,
              "temperature": args.temperature,
              "mean_abs_delta_logp": delta.mean().item(), "max_abs_delta_logp": delta.max().item(),
              "mean_logp": train_logp.mean().item(), "tokens": delta.numel()}
    log(json.dumps(result))
    write_json(f"logprob_delta_t{args.temperature:g}.json", result)


if __name__ == "__main__":
    run_benchmark(main)
