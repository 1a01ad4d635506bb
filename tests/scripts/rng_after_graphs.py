"""GPU check: torch's default CUDA generator still draws outside a graph after the hybrid engine's CUDA-graph decode
sampled (HF ``generate`` samples with ``torch.multinomial`` on it). Each stage prints ``ok`` or the error.

Usage: python tests/scripts/rng_after_graphs.py   (exits non-zero if a draw fails)
"""
import argparse
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hybrid_common import PAD, left_padded_batch, make_ds_engine, tiny_model  # noqa: E402

DEVICE = torch.device("cuda")


def draws_ok(stage):
    try:
        probs = torch.softmax(torch.randn(4, 16, device=DEVICE), dim=-1)
        torch.multinomial(probs, 1)
        torch.rand(3, device=DEVICE)
        print(f"{stage}: ok", flush=True)
        return True
    except RuntimeError as error:
        print(f"{stage}: FAILED {str(error).splitlines()[0]}", flush=True)
        return False


def failed_capture_leaves_draws_working(ids, mask):
    """A capture that fails (here: a host sync inside it, as a model's ``.item()`` would be) leaves torch's CUDA
    generators marked as capturing unless the engine repairs them: every later draw outside a graph then fails."""
    from dschat.hybrid_engine import HybridEngine, HybridEngineConfig
    from dschat.hybrid_engine.graphs import CapturedDecoder

    step = CapturedDecoder.step

    def syncing_step(self):
        if torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize()
        step(self)

    engine = make_ds_engine(tiny_model("llama", seed=1).to(DEVICE))
    hybrid = HybridEngine(engine, HybridEngineConfig(enabled=True, max_out_tokens=64, enable_cuda_graph=True),
                          pad_token_id=PAD)
    hybrid.eval()
    CapturedDecoder.step = syncing_step
    try:
        hybrid.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=True)
    finally:
        CapturedDecoder.step = step
    print(f"capture failed, eager fallback: {hybrid.graph_decoder.disabled_reason}", flush=True)
    return draws_ok("after a failed capture")


def main():
    # no flags; parsed so that --help (or a mistyped flag) does not run the check
    argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0]).parse_args()
    from dschat.hybrid_engine import HybridEngine, HybridEngineConfig

    results = [draws_ok("before any graph")]
    engine = make_ds_engine(tiny_model("llama").to(DEVICE))
    hybrid = HybridEngine(engine, HybridEngineConfig(enabled=True, max_out_tokens=64, enable_cuda_graph=True),
                          pad_token_id=PAD)
    hybrid.eval()
    ids, mask = (t.to(DEVICE) for t in left_padded_batch([7, 3, 5, 1]))
    own = torch.Generator(device=DEVICE).manual_seed(1)
    for stage, kwargs in (("greedy", {}), ("sampled, own generator", dict(do_sample=True, generator=own)),
                          ("sampled, default generator", dict(do_sample=True)),
                          ("sampled, top-k/top-p", dict(do_sample=True, top_k=8, top_p=0.9, generator=own))):
        hybrid.generate(ids, attention_mask=mask, max_new_tokens=16, **kwargs)
        hybrid.generate(ids, attention_mask=mask, max_new_tokens=16, **kwargs)  # a replay of the captured graph
        results.append(draws_ok(f"after a {stage} graph decode"))
    results.append(failed_capture_leaves_draws_working(ids, mask))
    torch.cuda.set_rng_state(torch.cuda.get_rng_state())  # as a resumed run's RNG restore does
    results.append(draws_ok("after the CUDA RNG state is set again"))
    if hybrid.graph_decoder is not None:
        hybrid.graph_decoder.drop()
    del hybrid, engine
    gc.collect()
    results.append(draws_ok("after the engine is gone"))
    print("ALL OK" if all(results) else "SOME DRAWS FAILED", flush=True)
    sys.exit(0 if all(results) else 1)


if __name__ == "__main__":
    main()
