"""GPU check of the first optimizer step in bf16 and fp16 at ZeRO-0, 1 and 2: Adam's first step moves each weight by
the learning rate (lr x the gradient's sign), its step count 1. At ZeRO-0 DeepSpeed 0.19's FP16_Optimizer (with
FusedAdam on a GPU) steps once with zero gradients as it is built, and Adam counted it (0.735 of the move): dschat's
initialize_engine takes that count back (uncount_state_allocation_step). The CPU test (tests/test_models.py) covers
FP16_UnfusedOptimizer with torch's AdamW; this one the GPU's wrappers and FusedAdam.

And at ZeRO-0 under weight decay the masters start as the model's weights (the setup step decayed them once).

Usage: python tests/scripts/first_step_gpu.py   (exits non-zero when a case fails; prints a line per case)
"""
import argparse
import sys

import torch


def first_step(dtype, stage):
    from dschat.models.loading import load_causal_lm, load_tokenizer
    from dschat.models.training_engine import initialize_engine
    from dschat.utils.ds_config import get_train_ds_config

    ds_config = get_train_ds_config(dtype=dtype, stage=stage)
    torch.manual_seed(0)
    engine = initialize_engine(load_causal_lm("tiny-gpt2", load_tokenizer("tiny-gpt2"), ds_config), ds_config, 1e-3,
                               0.0, None, "constant", 0, 10)
    masters = [p for group in engine.optimizer.optimizer.param_groups for p in group["params"]]
    ids = torch.randint(3, 96, (2, 6), generator=torch.Generator().manual_seed(1)).to(engine.device)
    for _ in range(8):  # (fp16: a step its loss scale overflowed is skipped; the first real one is measured)
        before = [p.detach().clone() for p in masters]
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        moved = torch.cat([(p.detach().float() - b.float()).abs().flatten() for p, b in zip(masters, before)])
        if moved.max().item() > 0:
            break
    steps = sorted({float(state["step"]) for state in engine.optimizer.optimizer.state.values() if "step" in state})
    median = moved.median().item()
    ok = abs(median - 1e-3) < 1e-5 and steps in ([1.0], [])
    print(f"{'ok  ' if ok else 'FAIL'} {dtype} ZeRO-{stage}: {type(engine.optimizer).__name__} over "
          f"{type(engine.optimizer.optimizer).__name__}, median move {median:.6f} (lr 0.001), Adam's step counts {steps}")
    engine.destroy()
    return ok


def masters_are_the_weights(dtype):
    """ZeRO-0 under weight decay: the setup step decayed the fp32 masters once (lr x weight_decay); initialize_engine
    copies them back from the model's weights (refresh_fp32_params), exactly."""
    from dschat.models.loading import load_causal_lm, load_tokenizer
    from dschat.models.training_engine import initialize_engine
    from dschat.utils.ds_config import get_train_ds_config

    ds_config = get_train_ds_config(dtype=dtype, stage=0)
    torch.manual_seed(0)
    engine = initialize_engine(load_causal_lm("tiny-gpt2", load_tokenizer("tiny-gpt2"), ds_config), ds_config, 0.1,
                               0.5, None, "constant", 0, 10)
    wrapper = engine.optimizer
    if hasattr(wrapper, "fp32_groups_flat"):  # FP16_Optimizer (fused): one flat master per group
        pairs = list(zip(wrapper.fp32_groups_flat, wrapper.fp16_groups_flat))
    else:
        pairs = [(m, p) for ms, ps in zip(wrapper.fp32_groups, wrapper.fp16_groups) for m, p in zip(ms, ps)]
    worst = max((master.detach() - param.detach().float()).abs().max().item() for master, param in pairs)
    ok = bool(pairs) and worst == 0
    print(f"{'ok  ' if ok else 'FAIL'} {dtype} ZeRO-0 weight decay 0.5, lr 0.1: {type(wrapper).__name__}, masters "
          f"differ from the model's weights by at most {worst:.3g}")
    engine.destroy()
    return ok


def main():
    from dschat.utils.dist import ensure_distributed

    argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()

    ensure_distributed()
    results = [first_step(dtype, stage) for dtype in ("bf16", "fp16") for stage in (0, 1, 2)]
    results += [masters_are_the_weights(dtype) for dtype in ("bf16", "fp16")]
    print(f"{sum(results)}/{len(results)} cases hold")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
