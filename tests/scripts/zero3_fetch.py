"""2 ranks, ZeRO-3: training with each decoder layer as DeepSpeed's fetch unit (``--zero3_fetch layer``) gives the
same losses and weights as DeepSpeed's per-submodule hooks (``module``), for Llama (GQA), OPT and GPT-2 tiny models,
with gradient checkpointing, through dschat's ``initialize_engine``; also with LoRA alone trained and no checkpointing
(frozen embeddings, and no checkpointing that would make their outputs require grad: without
``frozen_embeddings_pass_gradients`` DeepSpeed releases the first layer's weights before its backward). The first loss is bit-equal; after a step they
agree to fp32 rounding (the gradients are reduced in another bucket order).

Run by tests/test_ds_config.py through the deepspeed launcher.
"""
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hybrid_common import ds_config, tiny_model  # noqa: E402

STEPS = 3


def train(family, fetch, rank, lora_only=False):
    import deepspeed
    from deepspeed.utils import get_z3_leaf_modules

    from dschat.models.layers import decoder_layer_list
    from dschat.models.lora import apply_lora
    from dschat.steps.common import initialize_engine

    model = tiny_model(family, seed=5, num_layers=3)
    if lora_only:
        model = apply_lora(model, lora_dim=4, only_optimize_lora=True)
    config = ds_config(stage=3)
    config.pop("optimizer")
    config["train_batch_size"] = config["train_micro_batch_size_per_gpu"] * dist.get_world_size()
    engine = initialize_engine(model, config, lr=1e-2, weight_decay=0.0, lora_learning_rate=None, offload=False,
                               lr_scheduler_type="constant", num_warmup_steps=0, total_steps=STEPS,
                               gradient_checkpointing=not lora_only, zero3_fetch=fetch)
    leaves = get_z3_leaf_modules(engine.module)
    layers = list(decoder_layer_list(engine.module)[1])
    assert len(layers) == 3
    expected_leaves = layers if fetch == "layer" else []
    assert [id(m) for m in leaves] == [id(m) for m in expected_leaves], (family, fetch, len(leaves))
    # the layers' submodules carry no DeepSpeed hooks of their own: the layer's hook gathers their parameters
    inner_hooks = sum(len(m._forward_pre_hooks) for layer in layers for m in layer.modules() if m is not layer)
    assert (inner_hooks == 0) == (fetch == "layer"), (family, fetch, inner_hooks)
    g = torch.Generator().manual_seed(100 + rank)
    losses = []
    engine.train()
    for _ in range(STEPS):
        ids = torch.randint(3, 96, (2, 12), generator=g)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    weights = {}
    for name, p in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):
            weights[name] = p.detach().clone()
    return losses, weights


def main():
    from dschat.utils.dist import ensure_distributed

    rank, world = ensure_distributed()
    assert world == 2, world
    for family, lora_only in (("llama", False), ("opt", False), ("gpt2", False), ("llama", True)):
        by_layer, layer_weights = train(family, "layer", rank, lora_only)
        by_module, module_weights = train(family, "module", rank, lora_only)
        assert by_layer[0] == by_module[0], (family, by_layer, by_module)
        assert torch.allclose(torch.tensor(by_layer), torch.tensor(by_module), rtol=1e-5), (by_layer, by_module)
        assert by_layer[0] != by_layer[-1], by_layer  # the steps changed the weights
        for name, w in layer_weights.items():
            assert torch.allclose(w, module_weights[name], rtol=1e-5, atol=1e-4), \
                (family, name, (w - module_weights[name]).abs().max().item())  # Adam at lr 1e-2 moves a weight by ~1e-2 a step
        family += " lora only" if lora_only else ""
        print(f"rank {rank} {family}: layer == module, losses {[round(x, 5) for x in by_layer]}", flush=True)
    print(f"rank {rank} ALL OK", flush=True)


if __name__ == "__main__":
    main()
