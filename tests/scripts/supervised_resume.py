"""2 ranks, ZeRO-3: step 1 interrupted right after its step-4 checkpoint and resumed ends with the weights, train loss
and eval loss of the uninterrupted run (each rank's partitions, optimizer states, RNG and loss sums restored).

Run by tests/test_step_resume.py through the deepspeed launcher: ``supervised_resume.py <scratch folder>``.
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import SFT_FAST  # noqa: E402

from dschat.steps import resume, sft  # noqa: E402
from dschat.utils.dist import barrier, ensure_distributed, get_rank  # noqa: E402

STOP = 4


def main():
    from safetensors.torch import load_file

    out = Path(sys.argv[-1])
    ensure_distributed()
    common = [*SFT_FAST, "--max_seq_len", "48", "--data_split", "1,8,1", "--zero_stage", "3", "--max_steps", "6",
              "--per_device_train_batch_size", "8", "--dropout", "0.1", "--eval_iters", "1",
              "--data_output_path", str(out / "data")]
    full = sft.main([*common, "--output_dir", str(out / "full")])

    real_save, real_load, resumed_at = resume.save_step_checkpoint, resume.load_step_checkpoint, []

    def save_then_stop(engine, args, position, *rest):
        real_save(engine, args, position, *rest)
        if position["step"] == STOP:
            raise KeyboardInterrupt

    def load_recording(*given):
        position = real_load(*given)
        resumed_at.append(position["step"])
        return position

    resume.save_step_checkpoint, resume.load_step_checkpoint = save_then_stop, load_recording
    try:
        sft.main([*common, "--output_dir", str(out / "split"), "--save_interval", "2"])
        raise AssertionError("the run was to stop after its checkpoint")
    except KeyboardInterrupt:
        pass
    resume.save_step_checkpoint = real_save
    resumed = sft.main([*common, "--output_dir", str(out / "split"), "--resume"])
    print(f"rank {get_rank()} resumed from step {resumed_at[0]}", flush=True)
    # the mean over both ranks of each one's train loss: each rank's sums were restored, not rank 0's
    assert abs(resumed["train_loss"] - full["train_loss"]) < 1e-6, (resumed["train_loss"], full["train_loss"])
    assert abs(resumed["eval_loss"] - full["eval_loss"]) < 1e-6, (resumed["eval_loss"], full["eval_loss"])
    barrier()
    if get_rank() == 0:
        expected, got = load_file(str(out / "full" / "model.safetensors")), load_file(str(out / "split" /
                                                                                          "model.safetensors"))
        assert expected.keys() == got.keys()
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)
        print("ZeRO-3 resume: weights equal the uninterrupted run's", flush=True)


if __name__ == "__main__":
    from dschat.utils.cli import end_script

    main()
    end_script()  # (a gloo rank aborted in the interpreter's teardown now and then: exit 250)
