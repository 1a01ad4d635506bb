"""Inference tensor-parallel benchmark: the hybrid engine's generation with ``inference_tp_size`` 1 vs 2 on 2 GPUs
(or more: samples/s counts every rank's prompts).

Every rank holds B prompts (a data-parallel PPO job). With tp=1 each GPU generates its own B rows with the whole
model; with tp=2 both GPUs generate the group's 2B rows together, each with half of every split layer. Per rank and
variant: wall seconds of one PPO-style generation (``eval()`` with the ZeRO-3 refresh, ``generate``, ``train()``;
the slowest rank counts), gather seconds, the inference copy's bytes, peak memory, and the per-GPU floor (bytes
each GPU must read per decode step / copy bandwidth). Random weights, bf16, sampled, P prompt + G generated tokens.

    torchrun --nproc_per_node 2 bench/tensor_parallel.py --model qwen2.5-7b --batches 64 --stages 0,3 --tp 1,2

Needs 2 CUDA GPUs (the nvidia-h200-x2 machine). Prints a table on rank 0; writes JSON to $OUT when set.
"""
import argparse
import gc
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from generation import SHAPES, TORCH_LINEAR, copy_bandwidth, log  # noqa: E402
from results import (batch_error, choice_error, json_name, list_flag, positive_error, require_cuda,  # noqa: E402
                     run_benchmark, write_json)


def per_gpu_floor(inference_model, kv_heads_per_gpu, rows_per_gpu, prompt, gen, bw):
    """Bytes one GPU reads per decode step: the weights it generates with (under tp=2 its slices; the input embedding
    table is gathered, not read whole) and its KV cache so far."""
    emb = inference_model.get_input_embeddings().weight
    total = sum(p.numel() * p.element_size() for p in inference_model.parameters() if p is not emb)
    if inference_model.get_output_embeddings().weight is emb:
        total += emb.numel() * emb.element_size()
    cfg = inference_model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_per_token = 2 * cfg.num_hidden_layers * kv_heads_per_gpu * head_dim * 2
    return sum((total + kv_per_token * rows_per_gpu * (prompt + t)) / bw for t in range(gen))


def build_engine(model, stage, tp, graph):
    import deepspeed

    from dschat.hybrid_engine import HybridEngine, HybridEngineConfig

    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 1e4},
              "bf16": {"enabled": True}, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, config=config, dist_init_required=False)
    return HybridEngine(engine, HybridEngineConfig(enabled=True, max_out_tokens=1024, inference_tp_size=tp,
                                                   enable_cuda_graph=graph), pad_token_id=1, eos_token_id=2)


def synchronize():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def shape_of(args):
    if args.smoke:  # a 2-layer GQA model: checks the script on CPU ranks
        from transformers import Qwen2Config

        return Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    return SHAPES[args.model]()


def slowest(seconds, device):
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def run_variant(args, stage, tp, graph, batch, bw):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)  # the same weights on every rank
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(shape_of(args), dtype=args.dtype).eval()
    he = build_engine(model, stage, tp, graph)
    weights = he.inference_weights
    rank = dist.get_rank()
    g = torch.Generator(device=args.device).manual_seed(rank)
    prompt = torch.randint(4, model.config.vocab_size, (batch, args.prompt), device=args.device, generator=g)
    mask = torch.ones_like(prompt)
    kw = dict(max_new_tokens=args.gen, do_sample=True, top_k=0, top_p=1.0, eos_token_id=None, pad_token_id=1,
              generator=g)

    def one():
        he.mark_weights_stale()
        he.eval()
        out = he.generate(prompt, attention_mask=mask, **kw)
        he.train()
        return out

    synchronize()
    t = time.perf_counter()
    out = one()
    synchronize()
    first = slowest(time.perf_counter() - t, args.device)
    times = []
    for _ in range(args.repeats):
        dist.barrier()
        synchronize()
        t = time.perf_counter()
        out = one()
        synchronize()
        times.append(slowest(time.perf_counter() - t, args.device))
    stats = he.latency_stats(he.last_iteration)
    cfg = model.config
    kv_heads = weights.num_kv_heads or getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    floor = per_gpu_floor(weights.model, kv_heads, batch * tp, args.prompt, args.gen, bw)
    row = {"stage": stage, "tp": tp, "graph": graph, "batch_per_rank": batch, "rows_per_gpu": batch * tp,
           "seconds": sorted(times)[len(times) // 2], "first_call_s": first, "gather_s": stats.get("gather_latency"),
           "shape": list(out.shape), "copy_gb": getattr(weights, "nbytes", 0) / 1e9, "weights_kind": weights.kind,
           "peak_gb": torch.cuda.max_memory_allocated() / 1e9 if args.device == "cuda" else 0.0, "floor_s": floor,
           "graph_disabled": he.graph_decoder.disabled_reason if he.graph_decoder else None}
    # every rank's B prompts (it counted 2 GPUs: --nproc_per_node 4 or 8, docs/scaling.md's next runs, were halved or
    # quartered, and one rank doubled)
    row["world_size"] = dist.get_world_size()
    row["samples_per_s"] = row["world_size"] * batch / row["seconds"]
    del he, weights, model, out
    torch.nn.functional.linear = TORCH_LINEAR
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return row


def main():
    from dschat.args import positive_int  # (sizes of 0 failed deep inside the model or engine)

    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--model", default="qwen2.5-7b", choices=sorted(SHAPES))
    # (checked at parsing: a value that is no number failed on every rank with a traceback once the process group
    # had started, and --graph 2 ran with CUDA graphs on)
    p.add_argument("--batches", type=list_flag(batch_error), default="64")
    p.add_argument("--stages", type=list_flag(choice_error(["0", "1", "2", "3"], "a ZeRO stage")), default="0,3")
    p.add_argument("--tp", type=list_flag(positive_error("an inference_tp_size")), default="1,2")
    p.add_argument("--graph", type=list_flag(choice_error(["0", "1"], "CUDA graphs off or on")), default="1",
                   help="comma list of 0/1: CUDA graphs off/on")
    p.add_argument("--prompt", type=positive_int, default=256)
    p.add_argument("--gen", type=positive_int, default=256)
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--json", type=json_name, default="tensor_parallel.json")
    p.add_argument("--smoke", action="store_true", help="a tiny model on CPU ranks (gloo): checks the script only")
    p.add_argument("--local_rank", type=int, default=0)  # the deepspeed launcher passes it
    args = p.parse_args()
    if not args.smoke:
        require_cuda("--smoke checks the script on the CPU")
    args.device = "cpu" if args.smoke else "cuda"
    args.dtype = torch.float32 if args.smoke else torch.bfloat16
    from dschat.utils.dist import ensure_distributed, local_device

    ensure_distributed()
    if not args.smoke:  # the rank's GPU once the process group knows it (mpirun and srun set no LOCAL_RANK)
        torch.cuda.set_device(local_device())
    rank0 = dist.get_rank() == 0
    bw = 1e10 if args.smoke else copy_bandwidth()
    if rank0:
        import transformers

        device_name = "CPU (smoke)" if args.smoke else torch.cuda.get_device_name()
        log(f"torch {torch.__version__} transformers {transformers.__version__} {device_name} x "
            f"{dist.get_world_size()}, copy bandwidth {bw / 1e12:.2f} TB/s")
    rows = []
    for batch in map(int, args.batches.split(",")):
        for stage in map(int, args.stages.split(",")):
            for graph in (bool(int(x)) for x in args.graph.split(",")):
                for tp in map(int, args.tp.split(",")):
                    try:
                        row = run_variant(args, stage, tp, graph, batch, bw)
                        row["ok"] = True
                    except Exception as ex:  # reported, not fatal
                        row = {"ok": False, "stage": stage, "tp": tp, "graph": graph, "batch_per_rank": batch,
                               "error": f"{type(ex).__name__}: {str(ex)[:400]}"}
                        gc.collect()
                    if rank0:
                        log(json.dumps(row))
                    rows.append(row)
                    if rank0:
                        write_json(args.json, {"bandwidth_Bps": bw, "args": {**vars(args), "dtype": str(args.dtype)},
                                               "rows": rows})
    if rank0:
        log(f"\n{'B/rank':>6} {'ZeRO':>4} {'graph':>5} {'tp':>3} {'seconds':>8} {'floor/GPU':>9} {'x floor':>7} "
            f"{'gather':>7} {'copy GB':>8} {'peak GB':>8} {'samples/s':>9}")
        for r in rows:
            if not r["ok"]:
                log(f"{r['batch_per_rank']:>6} {r['stage']:>4} {r['graph']!s:>5} {r['tp']:>3} FAILED {r['error'][:90]}")
                continue
            floor = r["floor_s"]
            log(f"{r['batch_per_rank']:>6} {r['stage']:>4} {r['graph']!s:>5} {r['tp']:>3} {r['seconds']:>8.3f} "
                f"{floor if floor else float('nan'):>9.3f} {r['seconds'] / floor if floor else float('nan'):>7.2f} "
                f"{r['gather_s'] or 0:>7.3f} {r['copy_gb']:>8.2f} {r['peak_gb']:>8.1f} {r['samples_per_s']:>9.1f}")


if __name__ == "__main__":
    run_benchmark(main)
