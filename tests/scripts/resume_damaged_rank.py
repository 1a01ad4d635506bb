"""2 ranks: a --resume whose checkpoint rank 1 cannot load (its optimizer-state file cut short) stops both ranks
before either says it resumed, and the finished output keeps its finished mark (metrics.json): rank 0 used to load
its own files, say "resumed", remove metrics.json, and only then fail, so a later train.py --resume redid the step.

Run by tests/test_step_resume.py through the deepspeed launcher: ``resume_damaged_rank.py <scratch folder>``; it
exits with the entry point's status (not 0).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import SFT_FAST  # noqa: E402

from dschat.steps import sft  # noqa: E402
from dschat.utils.cli import run_script  # noqa: E402
from dschat.utils.dist import barrier, ensure_distributed, get_rank  # noqa: E402


def main():
    out = Path(sys.argv[-1])
    ensure_distributed()
    common = [*SFT_FAST, "--max_seq_len", "48", "--data_split", "1,8,1", "--zero_stage", "2", "--max_steps", "2",
              "--per_device_train_batch_size", "8", "--eval_iters", "1", "--save_interval", "2",
              "--data_output_path", str(out / "data"), "--output_dir", str(out / "run")]
    sft.main(common)
    barrier()
    if get_rank() == 0:
        optim = out / "run" / "checkpoints" / "model" / "step_0000002" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
        optim.write_bytes(optim.read_bytes()[:1000])
        print("finished; rank 1's optimizer states cut", flush=True)
    barrier()
    run_script(lambda: sft.main([*common, "--resume"]), resumable=True)  # (ends the process with its status)


if __name__ == "__main__":
    from dschat.utils.cli import end_script

    main()
    end_script()  # (a gloo rank aborted in the interpreter's teardown now and then: exit 250)
