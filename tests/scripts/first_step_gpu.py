"""GPU check of the first optimizer step in bf16 and fp16 at ZeRO-0, 1 and 2: Adam's first step moves each weight by
the learning rate (lr x the gradient's sign), its step count 1. At ZeRO-0 DeepSpeed 0.19's FP16_Optimizer (with
FusedAdam on a GPU) steps once with zero gradients as it is built, and Adam counted it (0.735 of the move): dschat's
initialize_engine takes that count back (uncount_state_allocation_step). The CPU test (tests/test_models.py) covers
FP16_UnfusedOptimizer with torch's AdamW; this one the GPU's wrappers and FusedAdam.

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


def main():
    from dschat.utils.dist import ensure_distributed

    argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()

    ensure_distributed()
    results = [first_step(dtype, stage) for dtype in ("bf16", "fp16") for stage in (0, 1, 2)]
    print(f"{sum(results)}/{len(results)} cases hold")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
