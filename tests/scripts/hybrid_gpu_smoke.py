"""Accelerator smoke check of the hybrid engine's decode path, without DeepSpeed (usable where it is not installed).

Greedy equality with HF ``generate`` for the tiny families in fp32 and bf16, host syncs per decode step, sampling with
a device generator, the merged-LoRA inference copy in bf16, and a decode-speed line against HF ``generate``.
Usage: python tests/scripts/hybrid_gpu_smoke.py   (prints a report; exits non-zero only on fp32 mismatches)
"""
import argparse
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hybrid_common import PAD, early_token, hf_generate, left_padded_batch, tiny_model  # noqa: E402

from dschat.hybrid_engine.cache import KVCache  # noqa: E402
from dschat.hybrid_engine.decode import forward_spec, generate_tokens  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def ours(model, ids, mask, max_new, **kwargs):
    cache = KVCache(model.config).acquire(ids.shape[0], ids.shape[1] + max_new, model.dtype, DEVICE)
    return generate_tokens(model, ids, mask, cache, max_new, pad_token_id=PAD, **kwargs)


def equality(dtype):
    failures = []
    for family in ["llama", "qwen2", "mistral", "opt", "gpt2"]:
        model = tiny_model(family, dtype=dtype).to(DEVICE).eval()
        ids, mask = (t.to(DEVICE) for t in left_padded_batch([7, 3, 5, 1]))
        eos = early_token(hf_generate(model, ids, mask, 16)[0, 7:])
        expected = hf_generate(model, ids, mask, 16, eos_token_id=eos)
        got = ours(model, ids, mask, 16, eos_token_id=eos)
        same = got.shape == expected.shape and torch.equal(got, expected)
        print(f"{dtype} {family}: {'equal' if same else 'DIFFERENT'} to HF generate", flush=True)
        if not same:
            failures.append(family)
    return failures


def syncs_per_step():
    model = tiny_model("llama").to(DEVICE).eval()
    ids, mask = (t.to(DEVICE) for t in left_padded_batch([7, 3, 5, 1]))
    ours(model, ids, mask, 4)
    if DEVICE.type != "cuda":
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        ours(model, ids, mask, 33, early_exit_interval=8)
        torch.cuda.set_sync_debug_mode(0)
    syncs = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)]
    print(f"host syncs in a 33-token generation (4 early-exit checks + 1 final read expected): {len(syncs)}")
    for line in sorted(set(syncs))[:5]:
        print("   ", line)


def sampling():
    model = tiny_model("llama", vocab_size=24).to(DEVICE).eval()
    ids, mask = (t.to(DEVICE) for t in left_padded_batch([5, 2], vocab_size=24))

    def draw(seed):
        g = torch.Generator(device=DEVICE).manual_seed(seed)
        return ours(model, ids, mask, 12, do_sample=True, top_k=10, top_p=0.9, generator=g)

    print(f"sampling: same seed same tokens {torch.equal(draw(1), draw(1))}, "
          f"other seed differs {not torch.equal(draw(1), draw(2))}")


def lora_bf16():
    import peft

    from dschat.hybrid_engine.weights import InferenceCopy

    model = tiny_model("llama", dtype=torch.bfloat16)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                       init_lora_weights=False)).to(DEVICE, torch.bfloat16).eval()
    weights = InferenceCopy(model, DEVICE, gather_group_size=1, share_unadapted=True)
    weights.refresh_if_stale()
    ids, mask = (t.to(DEVICE) for t in left_padded_batch([6, 2, 4]))
    same = torch.equal(ours(weights.model, ids, mask, 12), hf_generate(model, ids, mask, 12))
    print(f"bf16 LoRA merged copy vs PEFT generate (unmerged adapters): {'equal' if same else 'different'}")


def speed():
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                      num_attention_heads=16, num_key_value_heads=8, bos_token_id=None, eos_token_id=None)
    model = AutoModelForCausalLM.from_config(cfg).to(DEVICE, torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    batch, prompt, new = 32, 256, 256
    ids, mask = (t.to(DEVICE) for t in left_padded_batch([prompt - 8 * (i % 4) for i in range(batch)],
                                                           vocab_size=32000, total=prompt))
    for name, fn in [("dschat", lambda: ours(model, ids, mask, new)),
                     ("HF generate", lambda: hf_generate(model, ids, mask, new)),
                     ("HF generate static", lambda: hf_generate(model, ids, mask, new, cache_implementation="static"))]:
        fn()  # warm-up
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn()
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        print(f"speed {name}: {batch * (out.shape[1] - prompt) / seconds:.0f} tokens/s "
              f"({seconds:.2f}s, 1.1B-param llama, bf16, batch {batch}, {new} new tokens)", flush=True)


def main():
    # (parsed so that --help, or a mistyped flag, does not run the whole check)
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--speed", action="store_true", help="also time the decode against HF generate (a 1.1B-param "
                                                        "Llama, bf16)")
    args = p.parse_args()
    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, device {DEVICE}")
    print("forward spec:", forward_spec(tiny_model("llama")), forward_spec(tiny_model("gpt2")))
    failures = equality(torch.float32)
    equality(torch.bfloat16)
    syncs_per_step()
    sampling()
    lora_bf16()
    if args.speed:
        speed()
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
