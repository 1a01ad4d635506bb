"""DeepSpeed configs for training and frozen (eval-only) models, with DeepSpeed-Chat's knobs."""
from dschat.errors import MissingInputError, UsageError

DTYPE_KEYS = {"bf16": "bf16", "fp16": "fp16", "fp32": None}


def check_dtype_supported(dtype):
    """--dtype must be one DeepSpeed's accelerator trains in (e.g. no bf16 on a GPU before Ampere): said before any
    model loads, not as DeepSpeed's error from deep inside ``deepspeed.initialize``."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    supported = {"fp16": accelerator.is_fp16_supported, "bf16": accelerator.is_bf16_supported}
    if dtype in supported and not supported[dtype]():
        usable = [name for name, check in supported.items() if check()] + ["fp32"]
        raise UsageError(f"--dtype {dtype}: DeepSpeed's {accelerator.device_name()} accelerator cannot train in it; "
                         f"use --dtype {' or '.join(usable)}")


def _precision_block(dtype, check_grad_overflow=False):
    if dtype not in DTYPE_KEYS:
        raise UsageError(f"--dtype must be one of {sorted(DTYPE_KEYS)}, got {dtype!r}")
    key = DTYPE_KEYS[dtype]
    if key is None:
        return {}
    block = {"enabled": True}
    if key == "fp16":
        block["loss_scale_window"] = 100
    else:  # bf16: DeepSpeed's per-tensor overflow scan only when asked (see --check_grad_overflow)
        block["check_grad_overflow"] = check_grad_overflow
    return {key: block}


def get_train_ds_config(offload=False, dtype="bf16", stage=2, micro_batch_size=1, gradient_accumulation_steps=1,
                        world_size=1, enable_hybrid_engine=False, inference_tp_size=1,
                        release_inference_cache=False, pin_parameters=True, tp_gather_partition_size=8,
                        max_out_tokens=512, enable_cuda_graph=False, enable_tensorboard=False,
                        tb_path="", tb_name="", gradient_clipping=1.0, check_grad_overflow=False,
                        enable_mixed_precision_lora=False):
    """A training config: ZeRO stage, optional CPU offload of optimizer and (stage 3) parameters."""
    device = "cpu" if offload else "none"
    zero = {
        "stage": stage,
        "offload_param": {"device": device},
        "offload_optimizer": {"device": device},
        "stage3_param_persistence_threshold": 1e4,
        "stage3_max_live_parameters": 3e7,
        "stage3_prefetch_bucket_size": 3e7,
        "memory_efficient_linear": False,
    }
    if enable_mixed_precision_lora:  # Mixed Precision ZeRO++: frozen weights stored and gathered in int8
        from deepspeed.accelerator import get_accelerator

        zero["zero_quantized_nontrainable_weights"] = True
        devices = get_accelerator().device_count()
        if world_size != devices:  # several nodes: secondary partitions within each node (hpZ), as DeepSpeed-Chat
            zero["zero_hpz_partition_size"] = devices
    return {
        "train_batch_size": micro_batch_size * gradient_accumulation_steps * world_size,
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": gradient_accumulation_steps,
        "steps_per_print": 10**9,  # dschat prints its own progress
        "zero_optimization": zero,
        **_precision_block(dtype, check_grad_overflow),
        "gradient_clipping": gradient_clipping,
        "prescale_gradients": False,
        "wall_clock_breakdown": False,
        # dschat's own hybrid engine reads this block; DeepSpeed's is never enabled (see hybrid_engine.config). Its
        # switches as bools: the engine checks the block's types, and a notebook's release_inference_cache=1 stays 1
        "hybrid_engine": {
            "enabled": bool(enable_hybrid_engine),
            "max_out_tokens": max_out_tokens,
            "inference_tp_size": inference_tp_size,
            "release_inference_cache": bool(release_inference_cache),
            "pin_parameters": bool(pin_parameters),
            "tp_gather_partition_size": tp_gather_partition_size,
            "enable_cuda_graph": bool(enable_cuda_graph),
        },
        "tensorboard": {"enabled": enable_tensorboard, "output_path": f"{tb_path}/ds_tensorboard_logs/",
                        "job_name": f"{tb_name}_tensorboard"},
    }


def frozen_copy_stage(trained_stage, world_size, offload=False):
    """ZeRO stage of a frozen model (reference, reward, EMA copy) beside one trained at ``trained_stage``: sharded (3)
    when its twin is and there are several ranks to shard it over, or when its parameters go to the CPU (a ZeRO-3
    feature); otherwise a plain copy (0). On one rank ZeRO-3 splits nothing, holds the same full copy, and only adds
    its per-module hooks (the reference and reward forwards of an OPT-1.3B/350m PPO iteration left the GPU idle
    0.31 s on them, docs/benchmarks.md)."""
    return 3 if trained_stage == 3 and (world_size > 1 or offload) else 0


def get_eval_ds_config(offload=False, dtype="bf16", stage=0, micro_batch_size=1, world_size=1):
    """A config for frozen models (reference, reward): no optimizer; ZeRO-3 shards them if asked."""
    zero = {"stage": stage, "stage3_param_persistence_threshold": 1e4,
            "offload_param": {"device": "cpu" if offload else "none"}, "memory_efficient_linear": False}
    return {
        "train_batch_size": micro_batch_size * world_size,
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "steps_per_print": 10**9,
        "zero_optimization": zero,
        **_precision_block(dtype),
        "prescale_gradients": False,
        "wall_clock_breakdown": False,
    }


# --- a user's DeepSpeed config file (--deepspeed_config / --deepspeed PATH) ---------------------------------------
# Config keys that dschat's own flags set: the file may repeat them (or say "auto"), not contradict them, because the
# data loaders, the model's dtype, the optimizer and the actor's engine are built from the flags before DeepSpeed
# reads the config.
FLAG_OWNED_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size",
                   "zero_optimization.stage", "bf16.enabled", "bfloat16.enabled", "fp16.enabled",
                   "hybrid_engine.enabled")
# Blocks dschat builds itself from flags (it hands DeepSpeed its own optimizer and scheduler). HF Trainer's files
# write them with "auto" parameters, i.e. "from the flags": such a block is dropped, with a note.
DROPPED_BLOCKS = {"optimizer": ("--learning_rate / --weight_decay (step 3: --actor_learning_rate, ...)",
                                {"adam", "adamw", "fusedadam", "cpuadam"}),
                  "scheduler": ("--lr_scheduler_type / --num_warmup_steps", None)}
CONFIG_FLAGS = "--deepspeed_config / --deepspeed"


def load_user_ds_config(path):
    """The JSON object in ``path``, with an error naming the file when it is missing or not a JSON object."""
    import json
    import os

    path = os.path.expanduser(path)
    if not os.path.isfile(path):
        raise MissingInputError(f"DeepSpeed config {path!r} ({CONFIG_FLAGS}): no such file")
    with open(path, encoding="utf-8") as f:
        try:
            config = json.load(f)
        except json.JSONDecodeError as error:
            raise UsageError(f"DeepSpeed config {path!r}: not valid JSON ({error})") from None
        except UnicodeDecodeError as error:  # (UTF-16, as Windows' Notepad saves, or a binary file)
            raise UsageError(f"DeepSpeed config {path!r}: not UTF-8 text ({error})") from None
    if not isinstance(config, dict):
        raise UsageError(f"DeepSpeed config {path!r}: expected a JSON object, got {type(config).__name__}")
    return config


def owned_key_flags(micro_batch_flag, stage_flag, hybrid_flag="step 3's --enable_hybrid_engine"):
    """For each of FLAG_OWNED_KEYS, the flag that sets it (named in the error when a file contradicts it)."""
    return {"train_micro_batch_size_per_gpu": micro_batch_flag,
            "gradient_accumulation_steps": "--gradient_accumulation_steps",
            "train_batch_size": f"{micro_batch_flag} x --gradient_accumulation_steps x ranks",
            "zero_optimization.stage": stage_flag, "bf16.enabled": "--dtype", "bfloat16.enabled": "--dtype",
            "fp16.enabled": "--dtype", "hybrid_engine.enabled": hybrid_flag}


def _lookup(config, dotted):
    node = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _flag_value(generated, dotted):
    """What dschat's flags made of a flag-owned key (a precision block it did not write is off; DeepSpeed reads
    "bfloat16" as "bf16")."""
    value = _lookup(generated, dotted.replace("bfloat16.", "bf16.", 1))
    return False if value is None and dotted.endswith(".enabled") else value


def _check_flag_owned(generated, user, source, flags):
    """Every key the flags own that the file sets otherwise, in one error (not one per run)."""
    wrong = []
    for dotted in FLAG_OWNED_KEYS:
        wanted = _lookup(user, dotted)
        if wanted is None or wanted == "auto":
            continue
        have = _flag_value(generated, dotted)
        if wanted != have:
            wrong.append(f"{dotted} = {wanted!r}, but the flags give {have!r} (set it with {flags[dotted]})")
    if wrong:
        raise UsageError(f"DeepSpeed config {source}: {'; '.join(wrong)}: the flags set these (the file may repeat "
                         f"them or write \"auto\")")


def _drop_flag_built_blocks(user, source, say=True):
    """The file without its optimizer/scheduler blocks where they only say "take it from the flags" ("auto"
    parameters, an Adam optimizer); any other such block is an error naming the flags to use."""
    from dschat.utils.dist import print_rank_0

    for block, (use_instead, same_kinds) in DROPPED_BLOCKS.items():
        if block not in user:
            continue
        spec = user[block] if isinstance(user[block], dict) else {}
        params = spec.get("params", {})
        kind = str(spec.get("type", "")).lower()
        auto = isinstance(params, dict) and all(value == "auto" for value in params.values())
        if not auto or (same_kinds is not None and kind not in same_kinds):
            raise UsageError(f"DeepSpeed config {source}: dschat builds the {block!r} block itself; set it with "
                             f"{use_instead} (a block whose params are all \"auto\" is accepted)")
        if say:
            print_rank_0(f"[ds_config] {source}: the {block!r} block's parameters are \"auto\": dschat's own "
                         f"from {use_instead}")
    return {key: value for key, value in user.items() if key not in DROPPED_BLOCKS}


NOT_SET = object()  # a key dschat's config leaves out (DeepSpeed's default applies)


def _merge(base, override, changed, prefix=""):
    """``base`` updated from ``override`` recursively; "auto" keeps base's value (a block of only "auto" adds
    nothing). Appends to ``changed`` each (dotted key, base value or NOT_SET, new value) where the file replaced a
    value dschat had set or set one dschat leaves to DeepSpeed's default."""
    merged = dict(base)
    for key, value in override.items():
        if value == "auto":
            continue
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            current = merged.get(key)
            block = _merge(current if isinstance(current, dict) else {}, value, changed, dotted + ".")
            if block or key in merged:
                merged[key] = block
            continue
        if merged.get(key, NOT_SET) != value:
            changed.append((dotted, merged.get(key, NOT_SET), value))
        merged[key] = value
    return merged


def apply_user_ds_config(generated, source, flags, ignore=(), quiet=False):
    """``generated`` (a config built from dschat's flags) with the user's config merged over it: the file wins on
    every key except those in FLAG_OWNED_KEYS, which must agree with the flags (``flags`` maps such a key to the flag
    that sets it, for the error); "auto" keeps dschat's value; top-level blocks in ``ignore`` are not taken from the
    file (e.g. the hybrid engine block outside step 3's actor). Every value of dschat's that the file replaces is
    printed (unless ``quiet``). ``source``: a path, a dict (what ``deepspeed.initialize(config=...)`` also takes), or None (returns
    ``generated``)."""
    from dschat.utils.dist import print_rank_0

    if not source:
        return _check_offload_stage(generated)
    user, label = (source, "(dict)") if isinstance(source, dict) else (load_user_ds_config(source), repr(source))
    user = _drop_flag_built_blocks({k: v for k, v in _bf16_named(user).items() if k not in ignore}, label,
                                   say=not quiet)
    _check_flag_owned(generated, user, label, flags)
    changed = []
    merged = _merge(generated, user, changed)
    for dotted, old, new in [] if quiet else changed:
        was = "dschat leaves it to DeepSpeed" if old is NOT_SET else f"dschat's flags gave {old!r}"
        print_rank_0(f"[ds_config] {label}: {dotted} = {new!r} ({was})")
    return _check_offload_stage(merged)


def _bf16_named(user):
    """The file's "bfloat16" block (DeepSpeed's old name) as "bf16": DeepSpeed reads "bf16" first, so beside dschat's
    own "bf16" block the file's settings would be ignored without a word."""
    if "bfloat16" not in user:
        return user
    user = dict(user)
    old = user.pop("bfloat16")
    user["bf16"] = {**old, **user["bf16"]} if isinstance(old, dict) and isinstance(user.get("bf16"), dict) else \
        user.get("bf16", old)
    return user


def _check_offload_stage(config):
    """DeepSpeed offloads optimizer states only under ZeRO: at stage 0 its fp16/bf16 wrapper keeps the master weights
    on the GPU, and the CPU Adam that the offload asks for then fails on GPU tensors at the first step."""
    if optimizer_offloaded(config) and not _lookup(config, "zero_optimization.stage"):
        raise UsageError("optimizer offload (--offload, or offload_optimizer in the DeepSpeed config) needs ZeRO stage "
                         "1, 2 or 3 (--zero_stage; step 3: --actor_zero_stage / --critic_zero_stage), not 0")
    return config


def optimizer_offloaded(ds_config):
    """Whether the config puts optimizer states on the CPU/NVMe (then dschat builds DeepSpeed's CPU Adam)."""
    return _lookup(ds_config, "zero_optimization.offload_optimizer.device") in ("cpu", "nvme")


def user_ds_config_path(args):
    """The DeepSpeed config the arguments name: --deepspeed_config PATH (or a dict, from a notebook), or
    --deepspeed PATH (the form of HF Trainer and of many DeepSpeed-Chat walk-throughs); None when neither does."""
    import os

    from_config = getattr(args, "deepspeed_config", None)
    from_flag = getattr(args, "deepspeed", None)
    from_flag = from_flag if isinstance(from_flag, (str, dict)) else None
    if from_config and from_flag and not _same_config(from_config, from_flag, os.path):
        raise ValueError(f"--deepspeed {from_flag!r} and --deepspeed_config {from_config!r} name different configs")
    return from_config or from_flag


def _same_config(a, b, path):
    if isinstance(a, str) and isinstance(b, str):
        return path.realpath(path.expanduser(a)) == path.realpath(path.expanduser(b))
    return a == b
