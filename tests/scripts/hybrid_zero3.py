"""2 ranks, ZeRO-3: the hybrid engine's greedy tokens equal HF ``generate`` on a non-sharded copy, before and after an
optimizer step, for a plain and a LoRA actor. Rank 0's answers end within a few steps and rank 1's run to the limit,
so with ``--pin false`` (a collective in every forward) a rank that stopped on its own would hang the other.

``--fetch layer`` makes each decoder layer DeepSpeed's fetch unit (``--zero3_fetch``), as dschat's steps do by default;
with ``--pin false`` the decode loop's forwards then gather one layer per hook.

Run by tests/test_hybrid_engine_zero3.py through the deepspeed launcher, every case in one launch:
    hybrid_zero3.py --runs true:layer true:module false:layer false:module
"""
import argparse
import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hybrid_common import (PAD, check_refresh_after_step, ds_config, early_token, hf_generate,  # noqa: E402
                           left_padded_batch, tiny_model)

MAX_NEW = 20
NUM_LAYERS = 3


def rank_prompts(rank):
    if rank == 0:  # the same prompt twice, so both rows end at the same early step
        ids, mask = left_padded_batch([4], seed=10, total=6)
        return ids.repeat(2, 1), mask.repeat(2, 1)
    return left_padded_batch([7, 2, 5], seed=11)


def load_weights(model, reference):
    """Copy the reference's weights into a (possibly ZeRO-3-partitioned) model."""
    import deepspeed

    ref = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
            p.data.copy_(ref[name].data)


def build_zero3_actor(reference, lora_config, config, fetch):
    """The actor as users build it: base model under ``zero.Init``, LoRA added after, then ``deepspeed.initialize``."""
    import deepspeed
    import peft
    from transformers import AutoModelForCausalLM

    from dschat.compat import prepare_for_zero_init
    from dschat.models.training_engine import prepare_zero3_hooks

    prepare_for_zero_init()
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(base_config(reference)))
    if lora_config is not None:
        model = peft.get_peft_model(model, copy.deepcopy(lora_config))
    load_weights(model, reference)
    prepare_zero3_hooks(model, config, fetch)
    engine, *_ = deepspeed.initialize(model=model, config=config,
                                      model_parameters=[p for p in model.parameters() if p.requires_grad])
    return engine


def base_config(reference):
    base = reference.get_base_model() if hasattr(reference, "get_base_model") else reference
    return base.config


def check_gather_is_grouped(weights):
    """Wrap the copy step to record how many partitioned parameters are gathered at once."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    all_params = [p for c in weights.copies for p in c.training_params()]
    peak = [0]
    for c in weights.copies:
        original = c.load

        def load(original=original):
            gathered = sum(1 for p in all_params if p.ds_status == ZeroParamStatus.AVAILABLE)
            peak[0] = max(peak[0], gathered)
            original()

        c.load = load
    return peak


def run_case(pin, fetch, lora, rank, world):
    import peft

    from dschat.hybrid_engine import HybridEngine, HybridEngineConfig

    reference = tiny_model("llama", seed=21, num_layers=NUM_LAYERS)
    lora_config = None
    if lora:
        torch.manual_seed(22)
        lora_config = peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                      init_lora_weights=False)
        reference = peft.get_peft_model(reference, copy.deepcopy(lora_config))
    reference.eval()
    config = ds_config(stage=3, lr=5e-2)
    ids, mask = rank_prompts(rank)

    # EOS: a token rank 0's rows emit within 3 steps and rank 1's answers never contain; the same on both ranks.
    no_eos = hf_generate(reference, ids, mask, MAX_NEW)[:, ids.shape[1]:]
    answers = [None] * world
    dist.all_gather_object(answers, no_eos.tolist())
    eos = early_token(answers[0][0], avoid=[t for row in answers[1] for t in row])
    assert eos is not None, "no usable EOS token for this seed"
    expected = hf_generate(reference, ids, mask, MAX_NEW, eos_token_id=eos)
    lengths = [None] * world
    dist.all_gather_object(lengths, expected.shape[1] - ids.shape[1])
    assert lengths[0] <= 4 and lengths[1] == MAX_NEW, lengths  # rank 0 is done long before rank 1

    ds_engine = build_zero3_actor(reference, lora_config, config, fetch)
    engine = HybridEngine(ds_engine, HybridEngineConfig(enabled=True, max_out_tokens=64, pin_parameters=pin,
                                                        tp_gather_partition_size=1), pad_token_id=PAD)
    weights = engine.inference_weights
    if pin:
        assert weights.kind == ("lora_copy" if lora else "pinned_copy"), weights.kind
        assert len(weights.groups) == 1 + NUM_LAYERS
        peak = check_gather_is_grouped(weights)
    else:
        assert weights.kind == "training_module_zero3" and weights.forward_has_collectives

    engine.eval()
    got = engine.module.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=eos)
    assert torch.equal(got, expected), (rank, got, expected)
    again = engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=eos)
    assert torch.equal(again, expected)
    if not pin:  # a rank with no EOS at all still joins the others' finished-checks (each forward is a collective)
        from dschat.models.lora import unwrap_peft

        gen_config = unwrap_peft(engine.module).generation_config
        saved, gen_config.eos_token_id = gen_config.eos_token_id, None
        one_sided = engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW,
                                    eos_token_id=eos if rank == 0 else None)
        gen_config.eos_token_id = saved
        no_eos_expected = hf_generate(reference, ids, mask, MAX_NEW)
        assert torch.equal(one_sided, expected if rank == 0 else no_eos_expected), rank
    if pin:
        largest_group = max(sum(len(c.training_params()) for c in g) for g in weights.groups)
        assert 0 < peak[0] <= largest_group, (peak[0], largest_group)

    check_one_rank_refused(engine, ids, mask, eos, expected, rank)
    check_refresh_after_step(engine, reference, got, ids, mask, MAX_NEW, eos, expected, world)
    print(f"rank {rank} pin={pin} fetch={fetch} lora={lora}: OK (answer lengths {lengths}, "
          f"stats {engine.latency_stats()['gather_latency']:.4f}s gather)", flush=True)


def check_one_rank_refused(engine, ids, mask, eos, expected, rank):
    """Rank 1's prompts right-padded (its data alone is wrong): every rank raises, none waits alone in the weight
    gather or the decode's collectives, and the next generation runs on every rank."""
    bad_ids, bad_mask = (ids.flip(1), mask.flip(1)) if rank == 1 else (ids, mask)
    try:
        engine.generate(bad_ids, attention_mask=bad_mask, max_new_tokens=MAX_NEW, eos_token_id=eos)
    except ValueError as error:
        message = str(error)
    else:
        raise AssertionError(f"rank {rank}: a refused generation elsewhere did not stop this rank")
    assert ("LEFT-padded" if rank == 1 else "another rank, rank 1 (the lowest if several), refused its arguments") \
        in message, (rank, message)
    assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=eos), expected)


RUNS = [f"{pin}:{fetch}" for pin in ("true", "false") for fetch in ("layer", "module")]


def main():
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--runs", nargs="+", required=True, metavar="PIN:FETCH", choices=RUNS,
                        help="each (true|false):(layer|module) in turn, in one launch (the launcher and the ranks' "
                             "start take ~20 s each time)")
    parser.add_argument("--local_rank", type=int, default=0)  # passed by the deepspeed launcher
    args = parser.parse_args()

    from dschat.utils.dist import ensure_distributed

    rank, world = ensure_distributed()
    assert world == 2, world
    for pin, fetch in (run.split(":") for run in args.runs):
        for lora in (False, True):
            run_case(pin == "true", fetch, lora, rank, world)
            dist.barrier()
    print(f"rank {rank} ALL OK", flush=True)


if __name__ == "__main__":
    from dschat.utils.cli import end_script

    main()
    end_script()  # (a gloo rank aborted in the interpreter's teardown now and then: exit 250)
