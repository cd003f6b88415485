"""The seed's training-side view of the rollout (FastDeploy's `fastdeploy.rl`):

    from fdrollout import RolloutModelConfig, RolloutModel
    cfg = RolloutModelConfig(model_name_or_path="/models/base", tensor_parallel_size=2,
                             dynamic_load_weight=True, load_strategy="ipc_snapshot")
    rm = RolloutModel(cfg)
    rm.state_dict(rank=0)                   # {rollout name: float32 array} of tp rank 0
    rm.get_name_mappings_to_training()      # {rollout name: [training (HF) names]}

The rollout's names and shards are those of `fdctl model-info` and the C++ `RolloutModel`
(publish/include/fd/publish/rollout_model.h): q|k|v fused into `qkv_proj`, gate|up into
`gate_up_proj`, Megatron-style rows/columns per tensor-parallel rank, `lm_head` dropped when the
embeddings are tied (docs/weight_sources.md). A trainer uses the mapping to align its
checkpoint with what the rollout holds, and `state_dict()` to compare values.
"""
import os

from . import publish

LOAD_STRATEGIES = ("normal", "ipc_snapshot", "ipc", "rsync")


class RolloutModelConfig:
    def __init__(self, model_name_or_path, tensor_parallel_size=1, dynamic_load_weight=True,
                 load_strategy="normal"):
        if not os.path.isfile(os.path.join(model_name_or_path, "config.json")):
            raise ValueError(f"model_name_or_path {model_name_or_path!r}: no config.json there")
        if not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size {tensor_parallel_size!r} must be an integer >= 1")
        if load_strategy not in LOAD_STRATEGIES:
            raise ValueError(f"load_strategy {load_strategy!r}: one of {', '.join(LOAD_STRATEGIES)}")
        self.model_name_or_path = model_name_or_path
        self.tensor_parallel_size = tensor_parallel_size
        self.dynamic_load_weight = bool(dynamic_load_weight)
        self.load_strategy = load_strategy

    def __repr__(self):
        return (f"RolloutModelConfig(model_name_or_path={self.model_name_or_path!r}, "
                f"tensor_parallel_size={self.tensor_parallel_size}, dynamic_load_weight={self.dynamic_load_weight}, "
                f"load_strategy={self.load_strategy!r})")


# Which training tensors each fused rollout tensor concatenates (in this order, along dim 0), by
# the rollout name's last components: attention q|k|v, the dense / shared-expert / per-expert
# gate|up, and Mixtral's per-expert w1|w3.
_FUSED = {
    "qkv_proj.weight": ("q_proj.weight", "k_proj.weight", "v_proj.weight"),
    "qkv_proj.bias": ("q_proj.bias", "k_proj.bias", "v_proj.bias"),
    "gate_up_proj.weight": ("gate_proj.weight", "up_proj.weight"),
    "w13.weight": ("w1.weight", "w3.weight"),
}


def _training_names(name):
    for suffix, parts in _FUSED.items():
        if name.endswith("." + suffix):
            prefix = name[:-len(suffix)]
            return [prefix + p for p in parts]
    return [name]


class RolloutModel:
    """The rollout's state dict per tensor-parallel rank, built from the HF checkpoint in
    `cfg.model_name_or_path` (read lazily, once)."""

    def __init__(self, cfg):
        if not isinstance(cfg, RolloutModelConfig):
            raise TypeError("RolloutModel(cfg) takes a RolloutModelConfig")
        self.cfg = cfg
        self.config = publish.load_config(cfg.model_name_or_path)
        self._hf = None

    def _training(self):
        if self._hf is None:
            self._hf = publish.load_checkpoint(self.cfg.model_name_or_path)
        return self._hf

    def state_dict(self, rank=0):
        """{rollout name: numpy array} of tensor-parallel `rank` (float32 values)."""
        tp = self.cfg.tensor_parallel_size
        if not 0 <= rank < tp:
            raise ValueError(f"rank {rank} is outside tensor_parallel_size {tp}")
        return publish.to_rollout_names(self._training(), self.config, tp=tp, rank=rank)

    def get_name_mappings_to_training(self):
        """{rollout name: [training names]}: one name for a plain tensor, the parts in
        concatenation order for a fused one (q, k, v; gate, up; Mixtral's w1, w3)."""
        return {name: _training_names(name) for name in self.state_dict(0)}
