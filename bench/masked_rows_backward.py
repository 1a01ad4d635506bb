"""Are gradients finite when a padding mask leaves some query rows with nothing to attend to (left-padded rows)?

For each head size and SDPA backend: a tiny Llama (bf16) forward + backward over a left-padded batch with the
padding mask (the loss ignores the pad positions), then whether any parameter gradient is non-finite. Also SDPA
alone with a boolean mask whose first rows are all False. Then the same Llama (head size 32, as
``bench/graph_equality.py``'s) as a DeepSpeed ZeRO-0 / ZeRO-3 bf16 engine: the gradient norm of one step with and
without the left padding (that check's ZeRO-3 step had an infinite gradient norm on the H200 with a finite loss).

    python bench/masked_rows_backward.py        (needs a CUDA GPU; prints a table; JSON to $OUT)
"""
import argparse
import contextlib
import os
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # dschat, from a plain checkout
from results import run_benchmark, write_json  # noqa: E402

BACKENDS = {"default": None, "cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "math": SDPBackend.MATH}


def backend(name):
    return contextlib.nullcontext() if BACKENDS[name] is None else sdpa_kernel([BACKENDS[name]])


def tiny_llama(head_dim, device):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=4 * head_dim, intermediate_size=8 * head_dim, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    return LlamaForCausalLM(config).to(device, torch.bfloat16)


def left_padded(device, padded=True):
    ids = torch.randint(3, 128, (4, 32), device=device, generator=torch.Generator(device).manual_seed(1))
    mask = torch.ones_like(ids)
    if padded:
        mask[::2, :8] = 0  # left padding: those query rows see no key
    return ids, mask


def llama_grads_finite(head_dim, name, device):
    model = tiny_llama(head_dim, device)
    ids, mask = left_padded(device)
    with backend(name):
        out = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
        out.loss.backward()
    bad = [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
    return {"loss_finite": bool(torch.isfinite(out.loss)), "nonfinite_grads": len(bad), "first": bad[:2]}


def sdpa_grads_finite(head_dim, name, device):
    torch.manual_seed(0)
    q, k, v = (torch.randn(4, 4, 32, head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    keep = torch.ones(32, 32, dtype=torch.bool, device=device).tril()
    mask = keep[None, None].repeat(4, 1, 1, 1)
    mask[::2, :, :, :8] = False  # keys 0..7 padding for rows 0 and 2: their first 8 queries see nothing
    with backend(name):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    (out.float().nan_to_num().sum()).backward()
    return {"out_finite": bool(torch.isfinite(out).all()),
            "grads_finite": all(bool(torch.isfinite(t.grad).all()) for t in (q, k, v))}


def deepspeed_grad_norms(device):
    import deepspeed

    from dschat.utils.dist import ensure_distributed

    ensure_distributed()
    rows = []
    for stage in (0, 3):
        for padded in (False, True):
            model = tiny_llama(32, device)
            config = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**9, "bf16": {"enabled": True},
                      "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
            engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                              config=config, dist_init_required=False)
            ids, mask = left_padded(device, padded)
            loss = engine(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
            engine.backward(loss)
            engine.step()
            norm = engine.get_global_grad_norm()
            rows.append({"stage": stage, "left_padded": padded, "loss": loss.item(),
                         "grad_norm": float(norm) if norm is not None else None,
                         "step_applied": engine.was_step_applied()})
            print(rows[-1], flush=True)
    return rows


def main():
    # no flags; parsed so that --help (or a mistyped flag) does not run the benchmark
    argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0]).parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for head_dim in (16, 32, 64, 128):
        for name in BACKENDS:
            row = {"head_dim": head_dim, "backend": name}
            for label, fn in (("llama", llama_grads_finite), ("sdpa", sdpa_grads_finite)):
                try:
                    row[label] = fn(head_dim, name, device)
                except RuntimeError as error:  # a backend that does not take this shape / mask
                    row[label] = {"error": str(error).splitlines()[0][:100]}
            rows.append(row)
            print(row, flush=True)
    write_json("masked_rows_backward.json", {"device": device, "rows": rows,
                                              "deepspeed": deepspeed_grad_norms(device)})


if __name__ == "__main__":
    run_benchmark(main)
