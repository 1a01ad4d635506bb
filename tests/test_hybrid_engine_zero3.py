"""ZeRO-3 on 2 CPU ranks through the deepspeed launcher (tests/scripts/hybrid_zero3.py)."""
from pathlib import Path

import pytest

from tests.launch import launch_once, launched, run_deepspeed

SCRIPT = Path(__file__).parent / "scripts" / "hybrid_zero3.py"


CASES = [("true", "layer"), ("true", "module"), ("false", "layer"), ("false", "module")]


@pytest.fixture(scope="module")
def zero3_launch():
    """Every case in one launch; each test checks its own case's lines. The timeout turns a deadlock (ranks disagreeing
    on when to stop decoding) into a failure."""
    return launch_once(SCRIPT, "--runs", *(f"{pin}:{fetch}" for pin, fetch in CASES))


@pytest.mark.multirank
@pytest.mark.parametrize("pin,fetch", CASES)
def test_zero3_two_ranks_match_unsharded_reference(pin, fetch, zero3_launch):
    proc = launched(zero3_launch)
    for rank in (0, 1):
        assert f"rank {rank} pin={pin == 'true'} fetch={fetch} lora=False: OK" in proc.stdout
        assert f"rank {rank} pin={pin == 'true'} fetch={fetch} lora=True: OK" in proc.stdout
        assert f"rank {rank} ALL OK" in proc.stdout


@pytest.mark.multirank
def test_eval_or_generate_on_one_rank_alone_stops_every_rank_and_a_write_on_rank_0_reaches_every_copy():
    """tests/scripts/hybrid_zero3_out_of_step.py: rank 0's lone generate paired with rank 1's next eval() (the ranks
    then one collective apart, hanging later); now both raise, saying so. A parameter replaced on rank 0 alone raised
    there alone (rank 1 went on into the gather); now both raise. Replaced on rank 0 before a train() with no eval()
    or generate, it was refused on no rank (train() met none); the train() that begins a train phase meets the world
    now: both raise there, rank 0 naming it. That meeting also catches an eval() + generate on rank 0 alone (it met
    rank 1's next rollout, then waited for ever): both stop at rank 1's train(). The timeout turns a hang into a
    failure."""
    proc = run_deepspeed(Path(__file__).parent / "scripts" / "hybrid_zero3_out_of_step.py", timeout=300)
    for rank in (0, 1):
        for line in ("out of step: refused", "in step again", "write seen", "surgery on rank 0: refused",
                     "surgery undone: in step", "surgery before train(): refused", "lone generate: out of step at "
                     "train()", "ALL OK"):
            assert f"rank {rank} {line}" in proc.stdout, (rank, line, proc.stdout[-3000:])


@pytest.mark.multirank
def test_recurrent_rows_answer_as_alone_under_zero3_without_pinned_parameters_on_ranks_of_other_prompt_lengths(
        tmp_path):
    """ZeRO-3 on 2 ranks with hybrid_engine.pin_parameters off (each forward gathers the weights: a collective): a
    RecurrentGemma actor's left-padded batch decoded as it was, warned of, its padded rows answering otherwise than
    alone (its recurrence reads no mask). tests/scripts/hybrid_zero3_recurrent.py: each rank decodes the rows of each
    prompt length together without their padding, as one rank does, and makes spare decodes while the other rank has
    more lengths (2 and 4: without them the ranks hang); greedy answers as alone, with an EOS too; a rank whose batch
    decodes as it is (no padding; a hole, warned of) beside one of 4 lengths; the spare decodes leave the sampling
    generator as they found it. With --zero3_fetch module (each submodule gathering its own weights) rank 1's
    one-token prompt read conv_1d's weight where rank 0's called conv_1d: the ranks' gathers differed and gloo
    aborted; that is refused on both ranks (``layers.check_ranks_gather_alike``), and pinned the rows answer as
    alone. The timeout turns a hang into a failure."""
    proc = run_deepspeed(Path(__file__).parent / "scripts" / "hybrid_zero3_recurrent.py", "--folder",
                         tmp_path / "recurrent_gemma", timeout=300)
    for rank in (0, 1):
        for line in ("rows answer as alone", "rows answer as alone with an EOS", "a batch as it is beside prompt "
                     "lengths", "spare decodes leave the generator alone", "module fetch unpinned refused",
                     "module fetch pinned rows answer as alone"):
            assert f"rank {rank} {line}: OK" in proc.stdout, (rank, line, proc.stdout[-3000:])
    # warned of once, at rank 0's holed batch (the one it decodes as it is): its padded batches before went apart
    warning = "warning: the actor on RecurrentGemmaForCausalLM generates from left-padded prompts"
    assert proc.stdout.count(warning) == 1, proc.stdout[-3000:]
    assert proc.stdout.index(warning) > proc.stdout.index("rank 0 rows answer as alone with an EOS: OK")
