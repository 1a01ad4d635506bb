"""Check of --align_overflow on real fp16 DeepSpeed engines (loss scaling) at ZeRO-0, 2 and 3, on any accelerator that
trains in fp16: a GPU, or DeepSpeed's CPU accelerator on a CPU with AVX512-FP16 or AMX-FP16. For each stage, one
model's gradients (the actor's, the critic's, or both) are made to overflow (its loss times inf) on the last rank only;
the trainer's aligned step (``DeepSpeedPPOTrainer._step_actor_and_critic_aligned``) must then, on every rank, leave
both models' weights as they were, both engines must report the step not applied, neither lr scheduler may advance,
and only the overflowed model's loss scaler may react (the other's stays as it was); a following finite update must
then change both.

Usage: deepspeed --num_gpus N tests/scripts/align_overflow_fp16.py   (or python ... for a world of one; prints
PASS/FAIL lines, exits non-zero on a FAIL or where the accelerator cannot train in fp16)
"""
import argparse
import os
import re
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hybrid_common import FIRST_TOKEN, tiny_model  # noqa: E402

VOCAB = 96
STAGES = (0, 2, 3)  # fp16 at ZeRO-0 is DeepSpeed's FP16_Optimizer; 1 shares ZeRO-2's optimizer class
CASES = ("actor", "critic", "both")  # whose gradients overflow


def build_engine(seed, stage):
    """A tiny Llama as step 3 builds its actor and critic (``initialize_engine``: fused Adam, a linear lr schedule)."""
    from dschat.models.training_engine import initialize_engine
    from dschat.utils.ds_config import get_train_ds_config

    config = get_train_ds_config(dtype="fp16", stage=stage, micro_batch_size=2,
                                 world_size=torch.distributed.get_world_size())
    config["fp16"]["initial_scale_power"] = 8  # a scale the finite updates never overflow on their own
    return initialize_engine(tiny_model("llama", seed=seed, vocab_size=VOCAB), config, lr=1e-2, weight_decay=0.0,
                             lora_learning_rate=None, lr_scheduler_type="linear", num_warmup_steps=0, total_steps=100)


def aligned_trainer(actor, critic):
    """The step-3 trainer around the two engines, without the rest of step 3 (no reference, reward or data)."""
    from dschat.rlhf.config import step3_args
    from dschat.rlhf.trainer import DeepSpeedPPOTrainer

    trainer = DeepSpeedPPOTrainer.__new__(DeepSpeedPPOTrainer)
    trainer.args = step3_args({"dtype": "fp16", "align_overflow": True})
    trainer.actor_model, trainer.critic_model, trainer.actor_ema = actor, critic, None
    return trainer


def backward(engine, overflow, seed):
    """A step's backward on this rank; ``overflow``: its loss times inf on the last rank only (the others' gradients
    stay finite: the overflow check must still answer True on every rank, or the ranks would step apart)."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(FIRST_TOKEN, VOCAB, (2, 12), generator=generator).to(engine.device)
    loss = engine(input_ids=ids, labels=ids, use_cache=False).loss
    engine.backward(loss * float("inf") if overflow and rank == world - 1 else loss)


def weights(engine):
    """This rank's copy of the trained (fp16) weights: the whole tensors, or at ZeRO-3 the partitions."""
    return [getattr(p, "ds_tensor", p).detach().clone() for p in engine.module.parameters()]


def scaler(engine):
    """The loss scaler's state: scale, iteration, last overflow and (ZeRO-1/2/3) hysteresis."""
    optimizer = engine.optimizer
    held = getattr(optimizer, "loss_scaler", None) or optimizer.loss_scale_config  # ZeRO-1/2/3, ZeRO-0
    return {key: getattr(held, key) for key in ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")
            if hasattr(held, key)}


def state(engine):
    return {"weights": weights(engine), "epoch": engine.lr_scheduler.last_epoch, "lr": engine.get_lr()[0],
            "scaler": scaler(engine), "skipped": engine.skipped_steps}


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def say(line):
    """One line in one write (the launcher runs the ranks unbuffered into one pipe: print's text and newline, written
    apart, let another rank's line in between)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class Checks:
    def __init__(self, rank):
        self.failed, self.rank = 0, rank

    def __call__(self, label, ok, detail=""):
        say(f"{'PASS' if ok else 'FAIL'} rank {self.rank} {label}" + (f": {detail}" if detail and not ok else ""))
        self.failed += not ok


def run_case(check, stage, case):
    from dschat.rlhf.overflow import gradients_overflowed

    actor, critic = build_engine(0, stage), build_engine(1, stage)
    trainer = aligned_trainer(actor, critic)
    engines = {"actor": actor, "critic": critic}
    overflows = {name: case in (name, "both") for name in engines}
    tag = f"ZeRO-{stage} {case} overflow"
    for seed, (name, engine) in enumerate(engines.items()):
        backward(engine, overflows[name], seed)
    asked = {name: gradients_overflowed(engine) for name, engine in engines.items()}
    check(f"{tag}: overflow query", asked == overflows, f"asked {asked}, made {overflows}")
    before = {name: state(engine) for name, engine in engines.items()}
    trainer._step_actor_and_critic_aligned()
    for name, engine in engines.items():
        after = state(engine)
        check(f"{tag}: {name} weights unchanged", same(before[name]["weights"], after["weights"]))
        check(f"{tag}: {name} step not applied", not engine.was_step_applied())
        check(f"{tag}: {name} skipped steps + 1", after["skipped"] == before[name]["skipped"] + 1,
              f"{before[name]['skipped']} -> {after['skipped']}")
        check(f"{tag}: {name} lr scheduler not advanced",
              (after["epoch"], after["lr"]) == (before[name]["epoch"], before[name]["lr"]),
              f"{before[name]['epoch']} -> {after['epoch']}")
        # the overflowed model's scaler counts its overflow (halves the scale, or first uses up hysteresis); the one
        # made to skip keeps its scaler exactly as it was
        kept = after["scaler"] == before[name]["scaler"]
        check(f"{tag}: {name} loss scaler {'counted the overflow' if overflows[name] else 'kept'}",
              kept is not overflows[name], f"{before[name]['scaler']} -> {after['scaler']}")
    for seed, engine in enumerate(engines.values()):  # a finite update: both step
        backward(engine, False, seed + 10)
    before = {name: state(engine) for name, engine in engines.items()}
    trainer._step_actor_and_critic_aligned()
    for name, engine in engines.items():
        after = state(engine)
        check(f"{tag}, then a finite update: {name} step applied", engine.was_step_applied())
        check(f"{tag}, then a finite update: {name} weights changed",
              not same(before[name]["weights"], after["weights"]))
        check(f"{tag}, then a finite update: {name} lr scheduler advanced", after["epoch"] == before[name]["epoch"] + 1)


def main():
    # no flags but the launcher's; parsed so that --help (or a mistyped flag) does not run the checks
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--local_rank", type=int, default=0, help="(the deepspeed launcher passes it)")
    p.parse_args()
    from deepspeed.accelerator import get_accelerator

    from dschat.utils.dist import ensure_distributed

    accelerator = get_accelerator()
    if not accelerator.is_fp16_supported():
        say(f"FAIL DeepSpeed's {accelerator.device_name()} accelerator cannot train in fp16 (a CPU needs AVX512-FP16 "
            "or AMX-FP16)")
        return 1
    # DeepSpeed's op builder reads TORCH_CUDA_ARCH_LIST as numbers: "9.0a" (the H200 image's) fails its JIT build of
    # fused Adam with "invalid literal for int()"; the plain architecture builds the same kernels for this test
    os.environ["TORCH_CUDA_ARCH_LIST"] = re.sub(r"(\d+\.\d+)[a-z]\b", r"\1", os.environ.get("TORCH_CUDA_ARCH_LIST", ""))
    if not os.environ["TORCH_CUDA_ARCH_LIST"]:
        del os.environ["TORCH_CUDA_ARCH_LIST"]
    rank, world = ensure_distributed()  # the launcher's ranks, or a world of one
    check = Checks(rank)
    for stage in STAGES:
        for case in CASES:
            try:
                run_case(check, stage, case)
            except Exception as error:  # noqa: BLE001 (a crash is a FAIL of that case; the others still run)
                traceback.print_exc()
                check(f"ZeRO-{stage} {case} overflow: ran", False, f"{type(error).__name__}: {error}")
            accelerator.empty_cache()
    say(f"align_overflow fp16 check, rank {rank} of {world} on {accelerator.device_name()}: "
        f"{'FAILED ' + str(check.failed) if check.failed else 'all passed'}")
    return 1 if check.failed else 0


if __name__ == "__main__":
    from dschat.utils.cli import end_script

    end_script(main())  # (a gloo rank aborted in the interpreter's teardown now and then: exit 250)
