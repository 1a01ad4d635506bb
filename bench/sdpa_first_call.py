"""What a new sequence length costs the training-side attention: SDPA forward + backward as transformers calls it
for a padded batch (boolean mask) and for an unpadded one (causal, no mask), per backend, the first call at each
length (plan building included: cuDNN builds an execution plan per shape) and the steady call after it.

Why: in step 3 every new (prompt + answer) length reaches the actor, reference, critic and reward forwards and the
actor/critic backwards; a PPO benchmark's first padded iteration took 1-3 s longer, the profile putting the time
in ``aten::_cudnn_attention_forward/backward`` on the host.

    python bench/sdpa_first_call.py                  # OPT-1.3B's heads (32 x 64), batch 16, lengths 448,480,512

Prints milliseconds; writes JSON to $OUT when set.
"""
import argparse
import contextlib
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # dschat, from a plain checkout
from results import json_name, list_flag, positive_error, require_cuda, write_json  # noqa: E402

BACKENDS = {"default": None, "cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "flash": SDPBackend.FLASH_ATTENTION}


def fwd_bwd(q, k, v, mask):
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
    out.sum().backward()


def timed_ms(fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3


def main():
    from dschat.args import positive_int

    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--batch", type=positive_int, default=16)
    p.add_argument("--heads", type=positive_int, default=32)
    p.add_argument("--dim", type=positive_int, default=64)
    p.add_argument("--lengths", type=list_flag(positive_error("a sequence length")), default="448,480,512")
    p.add_argument("--json", type=json_name, default="sdpa_first_call.json")
    args = p.parse_args()
    require_cuda()
    warm = torch.randn(2, 2, 64, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    fwd_bwd(warm, warm, warm, None)  # CUDA context, cuBLAS handles: not any backend's first-call cost
    rows = []
    for backend, masked in [(b, m) for b in BACKENDS for m in (True, False)]:
        if backend == "flash" and masked:
            continue  # flash attention takes no mask
        for length in map(int, args.lengths.split(",")):
            q, k, v = (torch.randn(args.batch, args.heads, length, args.dim, device="cuda", dtype=torch.bfloat16,
                                   requires_grad=True) for _ in range(3))
            mask = None
            if masked:  # causal with the first 8 keys of every other row padded (left padding)
                mask = torch.ones(length, length, device="cuda", dtype=torch.bool).tril().expand(
                    args.batch, 1, length, length).clone()
                mask[::2, :, :, :8] = False
                mask[::2, :, :8, :8] = torch.eye(8, device="cuda", dtype=torch.bool)  # no fully masked row
            context = sdpa_kernel([BACKENDS[backend]]) if BACKENDS[backend] else contextlib.nullcontext()
            try:
                with context:
                    first = timed_ms(lambda: fwd_bwd(q, k, v, mask))
                    steady = min(timed_ms(lambda: fwd_bwd(q, k, v, mask)) for _ in range(5))
            except RuntimeError as error:
                print(f"{backend} masked={masked} L={length}: {str(error)[:150]}", flush=True)
                continue
            choice = torch._fused_sdp_choice(q, k, v, attn_mask=mask, is_causal=mask is None)  # default's pick
            row = {"backend": backend, "masked": masked, "length": length, "first_ms": first, "steady_ms": steady,
                   "default_picks": SDPBackend(choice).name}
            rows.append(row)
            print(f"{backend:<10} {'mask' if masked else 'causal':<7} L={length:<5} first {first:9.1f} ms   "
                  f"steady {steady:7.2f} ms   (default picks {row['default_picks']})", flush=True)
    write_json(args.json, {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
