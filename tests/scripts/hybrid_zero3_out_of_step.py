"""2 ranks, ZeRO-3 with a pinned inference copy: what one rank does alone to the hybrid engine.

1. ``engine.module.generate`` on rank 0 alone (a sample printed under ``if rank == 0:``) while rank 1 goes on to its
   next ``eval()``: their collectives used to pair up (rank 0's answer came back, the ranks were one call apart and
   the run hung or mixed collectives later); now both ranks raise an error that says they are out of step, and the
   next eval() + generate() on both ranks runs.
2. A write into a parameter inside ``GatheredParameters(modifier_rank=0)`` (through ``p.data``, by rank 0): every
   rank's copy sees it (the repartition moves each rank's shard's version), and the next generation reads it.
3. A parameter of the actor replaced on rank 0 alone (module surgery after the engine was built): it used to raise on
   rank 0 alone while rank 1's eval() went on (its all-reduce paired with rank 0's next call, or waited for ever); now
   both ranks' eval() raise, and with the parameter put back both generate in step.
4. The same replacement on rank 0, then train() with no eval() or generate: train() met no other rank, so neither
   refused (rank 0's optimizer trained the old parameter); the train() that begins a train phase is a meeting of the
   world now: both ranks raise there, rank 0 naming the parameter, rank 1 naming rank 0 (where to look); put back,
   both train a step in step.
5. A sample generated on rank 0 alone (eval() + generate under ``if rank == 0:``) made a rollout's meetings and met
   rank 1's next rollout; rank 0's own rollout then waited for ever. Its eval() meets rank 1's train() now: both stop,
   each saying which call it is in.

Run by tests/test_hybrid_engine_zero3.py through the deepspeed launcher.
"""
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hybrid_common import (PAD, check_surgery_on_rank_0_refused, gather_into, hf_generate,  # noqa: E402
                           left_padded_batch, make_ds_engine, rank_0_replaces, tiny_model, train_step)

MAX_NEW = 8


def generate(engine, ids, mask):
    engine.eval()
    return engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW)


def check_one_rank_alone_is_refused(engine, ids, mask, expected, rank):
    try:
        if rank == 0:
            engine.module.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW)
        else:
            engine.eval()
    except RuntimeError as error:
        message = str(error)
    else:
        raise AssertionError(f"rank {rank}: a generate on rank 0 alone was not refused")
    mine = "generate()" if rank == 0 else "eval()"
    assert f"out of step: this rank is in {mine} while another" in message, (rank, message)
    print(f"rank {rank} out of step: refused", flush=True)
    assert torch.equal(generate(engine, ids, mask), expected), rank
    print(f"rank {rank} in step again", flush=True)


def check_a_write_on_rank_0_is_seen_by_every_rank(engine, reference, ids, mask, rank):
    import deepspeed

    param = dict(engine.module.named_parameters())["model.layers.1.mlp.down_proj.weight"]
    before = hf_generate(reference, ids, mask, MAX_NEW)
    with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
        if rank == 0:
            param.data.copy_(dict(tiny_model("llama", seed=32).named_parameters())[
                "model.layers.1.mlp.down_proj.weight"].data)
    weights = engine.inference_weights
    weights.follow_writes()
    assert weights.is_stale, f"rank {rank}: the write on rank 0 left this rank's shard's version as it was"
    gather_into(reference, engine.module)
    expected = hf_generate(reference, ids, mask, MAX_NEW)
    assert not torch.equal(expected, before), "the write changed no answer: the test could not see stale weights"
    assert torch.equal(generate(engine, ids, mask), expected), rank
    print(f"rank {rank} write seen", flush=True)


def check_surgery_on_rank_0_alone_stops_every_rank(engine, ids, mask, rank):
    with rank_0_replaces(engine.module.model.layers[1].self_attn.o_proj, rank):
        check_surgery_on_rank_0_refused(rank, engine.eval)
    expected = engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW)
    assert torch.equal(generate(engine, ids, mask), expected), rank
    print(f"rank {rank} surgery undone: in step", flush=True)
    return expected


def check_surgery_before_training_stops_every_rank(engine, sequences, rank):
    with rank_0_replaces(engine.module.model.layers[1].self_attn.o_proj, rank):
        check_surgery_on_rank_0_refused(rank, engine.train)
    train_step(engine, sequences)
    print(f"rank {rank} surgery before train(): refused", flush=True)


def check_lone_generate_meets_the_others_train(engine, ids, mask, rank):
    if rank == 0:
        generate(engine, ids, mask)
    mine = "eval()" if rank == 0 else "train()"
    try:
        generate(engine, ids, mask)
        engine.train()
    except RuntimeError as error:
        assert f"out of step: this rank is in {mine} while another" in str(error), (rank, error)
    else:
        raise AssertionError(f"rank {rank}: an eval() + generate on rank 0 alone was not caught")
    print(f"rank {rank} lone generate: out of step at train()", flush=True)


def main():
    from dschat.hybrid_engine import HybridEngine, HybridEngineConfig
    from dschat.utils.dist import ensure_distributed

    rank, world = ensure_distributed()
    assert world == 2, world
    model = tiny_model("llama", seed=31)
    reference = copy.deepcopy(model)
    engine = HybridEngine(make_ds_engine(model, 3), HybridEngineConfig(enabled=True, max_out_tokens=32),
                          pad_token_id=PAD)
    assert engine.inference_weights.kind == "pinned_copy", engine.inference_weights.kind
    ids, mask = left_padded_batch([5, 3], seed=rank)
    expected = hf_generate(reference, ids, mask, MAX_NEW)
    assert torch.equal(generate(engine, ids, mask), expected), rank
    check_one_rank_alone_is_refused(engine, ids, mask, expected, rank)
    check_a_write_on_rank_0_is_seen_by_every_rank(engine, reference, ids, mask, rank)
    sequences = check_surgery_on_rank_0_alone_stops_every_rank(engine, ids, mask, rank)
    check_surgery_before_training_stops_every_rank(engine, sequences, rank)
    check_lone_generate_meets_the_others_train(engine, ids, mask, rank)
    print(f"rank {rank} ALL OK", flush=True)


if __name__ == "__main__":
    from dschat.utils.cli import end_script

    main()
    end_script()
