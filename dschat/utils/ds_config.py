"""DeepSpeed configs for training and frozen (eval-only) models, with DeepSpeed-Chat's knobs."""

DTYPE_KEYS = {"bf16": "bf16", "fp16": "fp16", "fp32": None}


def _precision_block(dtype, check_grad_overflow=False):
    if dtype not in DTYPE_KEYS:
        raise ValueError(f"--dtype must be one of {sorted(DTYPE_KEYS)}, got {dtype!r}")
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
                        tb_path="", tb_name="", gradient_clipping=1.0, check_grad_overflow=False):
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
        # dschat's own hybrid engine reads this block; DeepSpeed's is never enabled (see hybrid_engine.config)
        "hybrid_engine": {
            "enabled": enable_hybrid_engine,
            "max_out_tokens": max_out_tokens,
            "inference_tp_size": inference_tp_size,
            "release_inference_cache": release_inference_cache,
            "pin_parameters": pin_parameters,
            "tp_gather_partition_size": tp_gather_partition_size,
            "enable_cuda_graph": enable_cuda_graph,
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
