"""2 ranks, ZeRO-3 with ``hybrid_engine.pin_parameters`` off (every forward all-gathers the weights: a collective): a
RecurrentGemma actor (recurrent layers that read no attention mask) answers left-padded prompts as each prompt alone,
each rank generating the rows of each prompt length together without their padding, although the ranks hold other
numbers of prompt lengths: rank 0 makes fewer decodes than rank 1, so it must make spare ones in step with rank 1's
(or the ranks hang); with an EOS that ends rows at other steps; where a rank's batch has no padding or a hole (decoded
as it is) beside a rank of several prompt lengths; and sampling, the spare decodes leave the sampling generator as
they found it. All with ZeRO-3 gathering each decoder layer as one unit (``--zero3_fetch layer``); gathering
submodule by submodule (``module``) the ranks gathered other weights, so that is refused unpinned, and pinned the rows
answer as alone.

Run by tests/test_hybrid_engine_zero3.py through the deepspeed launcher.
"""
import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import tiny_recurrent_gemma_actor  # noqa: E402
from hybrid_common import PAD, early_token, hf_generate_alone, left_padded_batch, with_biases, zero3_actor  # noqa: E402

MAX_NEW = 8
# rank 0: 2 prompt lengths (two rows of 5 together), rank 1: 4; the ranks share lengths 2 and 5 (other prompts)
PROMPT_LENGTHS = {0: [5, 2, 5], 1: [3, 7, 2, 1, 5]}


def expected_answers(model, ids, mask, eos=None):
    """The left-padded prompts followed by each row's greedy answer generated alone from its real tokens, padded to
    the longest answer (as one batched generate returns them)."""
    width = ids.shape[1]
    answers = [hf_generate_alone(model, row[m.bool()][None], MAX_NEW, eos_token_id=eos)[0, int(m.sum()):]
               for row, m in zip(ids, mask)]
    out = torch.full((ids.shape[0], width + max(len(a) for a in answers)), PAD, dtype=ids.dtype)
    out[:, :width] = ids
    for row, answer in enumerate(answers):
        out[row, width:width + len(answer)] = answer
    return out


def check_rows_answer_as_alone(engine, reference, rank, eos=None):
    ids, mask = left_padded_batch(PROMPT_LENGTHS[rank], seed=50 + rank)
    got = engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos)
    expected = expected_answers(reference, ids, mask, eos)
    assert torch.equal(got, expected), (rank, eos, got.tolist(), expected.tolist())


def an_eos_ending_some_rows_early(reference, rank):
    """A token that rank 0's first row generates within 3 steps alone (it ends there, the others later or never), the
    same on both ranks."""
    ids, mask = left_padded_batch(PROMPT_LENGTHS[0], seed=50)
    answer = expected_answers(reference, ids[:1], mask[:1])[0, ids.shape[1]:]
    eos = torch.tensor([early_token(answer) or -1])
    dist.broadcast(eos, src=0)
    assert int(eos) >= 0, "no usable EOS token for this seed"
    return int(eos)


def check_a_batch_decoded_as_it_is_beside_prompt_lengths(engine, reference, rank):
    """Rank 0's batch decodes as it is, once (no padding; a hole), while rank 1 decodes 4 prompt lengths: rank 0 makes
    3 spare decodes. Its unpadded rows answer as alone (those of the holed batch are not checked: the hole moves
    them); rank 1's rows answer as alone."""
    ids, mask = left_padded_batch(PROMPT_LENGTHS[rank], seed=50 + rank)
    if rank == 0:
        ids, mask = left_padded_batch([4, 4], seed=60)
    got = engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False)
    assert torch.equal(got, expected_answers(reference, ids, mask)), (rank, got.tolist())
    if rank == 0:
        ids, mask = left_padded_batch([5, 3], seed=61)
        mask[0, 1] = 0  # (a hole in row 0's prompt: the batch cannot leave its padding out)
    engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False)


def check_spare_decodes_leave_the_generator_alone(engine, rank):
    """Rank 0 samples its rows (2 prompt lengths) twice from the same seed: beside rank 1's 4 prompt lengths (2 spare
    decodes) and beside 2 (none). Its answers and its generator's state after are the same both times."""
    ids, mask = left_padded_batch(PROMPT_LENGTHS[0], seed=50)
    results = []
    for rank_1_lengths in (PROMPT_LENGTHS[1], [6, 2]):
        if rank == 1:
            ids, mask = left_padded_batch(rank_1_lengths, seed=70)
        generator = torch.Generator().manual_seed(5 + rank)
        got = engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=True, top_k=0,
                              generator=generator)
        results.append((got, generator.get_state()))
    if rank == 0:
        (first, first_state), (second, second_state) = results
        assert torch.equal(first, second), (first.tolist(), second.tolist())
        assert torch.equal(first_state, second_state), "the spare decodes drew from the sampling generator"


class Tokenizer:
    """What loading reads of a tokenizer."""
    pad_token_id, eos_token_id = PAD, None

    def __len__(self):
        return 96


def unpinned_engine(ds_engine):
    from dschat.hybrid_engine import HybridEngine, HybridEngineConfig

    engine = HybridEngine(ds_engine, HybridEngineConfig(enabled=True, max_out_tokens=64, pin_parameters=False),
                          pad_token_id=PAD)
    assert engine.inference_weights.forward_has_collectives
    return engine


def check_layer_fetch(folder, reference, rank):
    """Every check, ZeRO-3 gathering each decoder layer's weights as one unit (``--zero3_fetch layer``)."""
    from dschat.models.training_engine import release_engine

    ds_engine = zero3_actor(folder, Tokenizer(), zero3_fetch="layer")
    assert all(p.numel() == 0 for p in ds_engine.module.parameters()), "every weight partitioned"
    engine = unpinned_engine(ds_engine)
    engine.eval()
    check_rows_answer_as_alone(engine, reference, rank)
    print(f"rank {rank} rows answer as alone: OK", flush=True)
    check_rows_answer_as_alone(engine, reference, rank, eos=an_eos_ending_some_rows_early(reference, rank))
    print(f"rank {rank} rows answer as alone with an EOS: OK", flush=True)
    check_a_batch_decoded_as_it_is_beside_prompt_lengths(engine, reference, rank)
    print(f"rank {rank} a batch as it is beside prompt lengths: OK", flush=True)
    check_spare_decodes_leave_the_generator_alone(engine, rank)
    print(f"rank {rank} spare decodes leave the generator alone: OK", flush=True)
    release_engine(engine)


def check_module_fetch(folder, reference, rank):
    """ZeRO-3 gathering submodule by submodule (``--zero3_fetch module``): rank 1's one-token prompt's prefill reads
    conv_1d's weight where rank 0's two-token prompts call conv_1d, so the ranks gathered other weights (gloo:
    "Received data size doesn't match expected size") in the first decode. Unpinned, the engine is refused on both
    ranks, naming --zero3_fetch layer; pinned (one gather into a copy, forwards without collectives), as the refusal
    advises, the rows answer as alone."""
    from dschat.hybrid_engine import HybridEngine, HybridEngineConfig
    from dschat.models.training_engine import release_engine

    ds_engine = zero3_actor(folder, Tokenizer(), zero3_fetch="module")
    try:
        unpinned_engine(ds_engine)
    except ValueError as error:
        assert "--zero3_fetch layer" in str(error) and "conv_1d" in str(error), str(error)
    else:
        raise AssertionError(f"rank {rank}: an unpinned engine gathering submodule by submodule was built")
    print(f"rank {rank} module fetch unpinned refused: OK", flush=True)
    engine = HybridEngine(ds_engine, HybridEngineConfig(enabled=True, max_out_tokens=64), pad_token_id=PAD)
    engine.eval()
    check_rows_answer_as_alone(engine, reference, rank)
    print(f"rank {rank} module fetch pinned rows answer as alone: OK", flush=True)
    release_engine(engine)


def main():
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--folder", required=True, help="where rank 0 saves the model both ranks load")
    parser.add_argument("--local_rank", type=int, default=0)  # passed by the deepspeed launcher
    args = parser.parse_args()

    from dschat.utils.dist import ensure_distributed

    rank, world = ensure_distributed()
    assert world == 2, world
    reference = with_biases(tiny_recurrent_gemma_actor())  # (its head untied: answers that vary)
    if rank == 0:
        reference.save_pretrained(args.folder)
    dist.barrier()
    check_layer_fetch(args.folder, reference, rank)
    dist.barrier()
    check_module_fetch(args.folder, reference, rank)


if __name__ == "__main__":
    from dschat.utils.cli import end_script

    main()
    end_script()
