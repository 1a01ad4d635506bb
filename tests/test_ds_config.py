"""DeepSpeed configs built by dschat: the bf16 overflow scan (host time on every step) is off unless asked, and
DeepSpeed's own config model reads dschat's setting."""
from types import SimpleNamespace

from deepspeed.runtime.precision_config import get_bfloat16_config

from dschat.args import step1_parser, step3_parser
from dschat.rlhf.config import step3_args
from dschat.utils.ds_config import get_train_ds_config


def test_bf16_overflow_scan_is_off_unless_asked_and_deepspeed_reads_it():
    assert get_bfloat16_config(get_train_ds_config(dtype="bf16")).check_grad_overflow is False
    assert get_bfloat16_config(get_train_ds_config(dtype="bf16", check_grad_overflow=True)).check_grad_overflow
    assert "check_grad_overflow" not in get_train_ds_config(dtype="fp16")["fp16"], "fp16 always checks"
    assert "bf16" not in get_train_ds_config(dtype="fp32")


def test_check_grad_overflow_flag_reaches_the_step_configs():
    assert step1_parser().parse_args(["--check_grad_overflow"]).check_grad_overflow
    args = step3_parser().parse_args(["--actor_model_name_or_path", "a", "--critic_model_name_or_path", "c"])
    assert args.check_grad_overflow is False

    from dschat.rlhf.engine import DeepSpeedRLHFEngine

    for flag in (False, True):
        settings = step3_args({"actor_model_name_or_path": "a", "critic_model_name_or_path": "c",
                               "check_grad_overflow": flag})
        config = DeepSpeedRLHFEngine._train_config(SimpleNamespace(args=settings, world_size=1), 2)
        assert config["bf16"]["check_grad_overflow"] is flag
