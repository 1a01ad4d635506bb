"""The ``hybrid_engine`` block of a DeepSpeed config, read for dschat's engine instead of DeepSpeed's."""
import copy
import dataclasses

HYBRID_ENGINE = "hybrid_engine"


@dataclasses.dataclass
class HybridEngineConfig:
    """Field names and defaults follow DeepSpeed's ``DeepSpeedHybridEngineConfig`` so configs carry over."""

    enabled: bool = False
    max_out_tokens: int = 512
    inference_tp_size: int = 1
    release_inference_cache: bool = False
    pin_parameters: bool = True
    tp_gather_partition_size: int = 8
    enable_cuda_graph: bool = False

    def __post_init__(self):
        if self.max_out_tokens < 1:
            raise ValueError(f"hybrid_engine.max_out_tokens must be >= 1, got {self.max_out_tokens}")
        if self.tp_gather_partition_size < 1:
            raise ValueError("hybrid_engine.tp_gather_partition_size must be >= 1, "
                             f"got {self.tp_gather_partition_size}")
        if self.inference_tp_size < 1:
            raise ValueError(f"hybrid_engine.inference_tp_size must be >= 1, got {self.inference_tp_size}")

    @classmethod
    def from_ds_config(cls, ds_config):
        """Read the ``hybrid_engine`` block (absent block -> defaults); unknown keys are an error, as in DeepSpeed, and
        so are values of another type (a config file's "64" or "false": a string "false" would switch a setting on)."""
        block = dict((ds_config or {}).get(HYBRID_ENGINE) or {})
        fields = {f.name: f.type for f in dataclasses.fields(cls)}
        unknown = sorted(set(block) - set(fields))
        if unknown:
            raise ValueError(f"unknown hybrid_engine option(s) {unknown}; known: {sorted(fields)}")
        wrong = [f"{key} = {value!r} (not {fields[key].__name__})" for key, value in block.items()
                 if not _is_a(value, fields[key])]
        if wrong:
            raise ValueError(f"hybrid_engine: {'; '.join(wrong)}")
        return cls(**block)


def _is_a(value, kind):
    """Whether ``value`` is of ``kind`` (a bool is no int here, though Python's bool is one)."""
    return isinstance(value, kind) and not (kind is int and isinstance(value, bool))


def strip_deepspeed_hybrid_engine(ds_config):
    """A copy of ``ds_config`` without the ``hybrid_engine`` block.

    Passed to ``deepspeed.initialize`` so DeepSpeed never builds its own hybrid engine (and its inference kernels);
    the block is read by :meth:`HybridEngineConfig.from_ds_config` for dschat's engine instead.
    """
    stripped = copy.deepcopy(ds_config)
    stripped.pop(HYBRID_ENGINE, None)
    return stripped
