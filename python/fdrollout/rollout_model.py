"""The seed's training-side view of the rollout (FastDeploy's `fastdeploy.rl`):

    from fdrollout import RolloutModelConfig, RolloutModel
    cfg = RolloutModelConfig(model_name_or_path="/models/base", tensor_parallel_size=2,
                             dynamic_load_weight=True, load_strategy="ipc_snapshot")
    rm = RolloutModel(cfg)
    rm.state_dict(rank=0)                   # {rollout name: float32 array} of tp rank 0
    rm.get_name_mappings_to_training()      # {rollout name: [training (HF) names]}, every rank's

With `enable_expert_parallel=True` (FastDeploy's / vLLM's name; the daemon's
--enable-expert-parallel) each rank's state dict holds only its experts, whole:
`rm.rank_experts(r)` is their range, `rm.get_name_mappings_to_training(rank=r)` that rank's mapping.

The rollout's names and shards are those of `fdctl model-info` and the C++ `RolloutModel`
(publish/include/fd/publish/rollout_model.h): q|k|v fused into `qkv_proj`, gate|up into
`gate_up_proj`, Megatron-style rows/columns per tensor-parallel rank, `lm_head` dropped when the
embeddings are tied (docs/weight_sources.md). A trainer uses the mapping to align its
checkpoint with what the rollout holds, and `state_dict()` to compare values.
"""
import numbers
import os

from . import publish

LOAD_STRATEGIES = ("normal", "ipc_snapshot", "ipc", "rsync")


def _integer(value):
    """`value` as an int when it is an integral number (numpy's too: np.int64(2) was refused while
    True passed, a probe); None for a bool or anything else."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return int(value)


class RolloutModelConfig:
    """Errors  ValueError naming the argument: no config.json, a tensor_parallel_size that is not
    an integer >= 1 (a bool is not one), an unknown load_strategy, a non-bool
    enable_expert_parallel."""

    def __init__(self, model_name_or_path, tensor_parallel_size=1, dynamic_load_weight=True,
                 load_strategy="normal", enable_expert_parallel=False):
        if not os.path.isfile(os.path.join(model_name_or_path, "config.json")):
            raise ValueError(f"model_name_or_path {model_name_or_path!r}: no config.json there")
        tp = _integer(tensor_parallel_size)
        if tp is None or tp < 1:
            raise ValueError(f"tensor_parallel_size {tensor_parallel_size!r} must be an integer >= 1")
        if load_strategy not in LOAD_STRATEGIES:
            raise ValueError(f"load_strategy {load_strategy!r}: one of {', '.join(LOAD_STRATEGIES)}")
        self.model_name_or_path = model_name_or_path
        self.tensor_parallel_size = tp
        self.dynamic_load_weight = bool(dynamic_load_weight)
        self.load_strategy = load_strategy
        if not isinstance(enable_expert_parallel, bool):
            raise ValueError(f"enable_expert_parallel {enable_expert_parallel!r} must be a bool")
        self.enable_expert_parallel = enable_expert_parallel

    def __repr__(self):
        return (f"RolloutModelConfig(model_name_or_path={self.model_name_or_path!r}, "
                f"tensor_parallel_size={self.tensor_parallel_size}, dynamic_load_weight={self.dynamic_load_weight}, "
                f"load_strategy={self.load_strategy!r}, enable_expert_parallel={self.enable_expert_parallel})")


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
        if cfg.enable_expert_parallel:  # refused now, naming why: a dense model, or tp not dividing the experts
            publish.rank_experts(self.config, cfg.tensor_parallel_size, 0, True)

    def _training(self):
        if self._hf is None:
            self._hf = publish.load_checkpoint(self.cfg.model_name_or_path)
        return self._hf

    def _check_rank(self, rank):
        """`rank` as an int. Errors  ValueError when it is not an integer in [0, tp) (a bool is not one)."""
        tp = self.cfg.tensor_parallel_size
        r = _integer(rank)
        if r is None or not 0 <= r < tp:
            raise ValueError(f"rank {rank!r} must be an integer in [0, {tp}) (tensor_parallel_size {tp})")
        return r

    def rank_experts(self, rank=0):
        """range(begin, end): the experts of each sparse layer `rank` holds (all of them without
        expert parallelism; empty for a dense model)."""
        rank = self._check_rank(rank)
        return publish.rank_experts(self.config, self.cfg.tensor_parallel_size, rank, self.cfg.enable_expert_parallel)

    def state_dict(self, rank=0):
        """{rollout name: numpy array} of tensor-parallel `rank` (float32 values); under expert
        parallelism only that rank's experts, whole."""
        rank = self._check_rank(rank)
        return publish.to_rollout_names(self._training(), self.config, tp=self.cfg.tensor_parallel_size, rank=rank,
                                        expert_parallel=self.cfg.enable_expert_parallel)

    def get_name_mappings_to_training(self, rank=None):
        """{rollout name: [training names]}: one name for a plain tensor, the parts in
        concatenation order for a fused one (q, k, v; gate, up; Mixtral's w1, w3). Every rank's
        tensors (every expert); `rank`: only the tensors that rank holds."""
        if rank is None:  # the same names on every rank unless each holds its own experts
            ranks = range(self.cfg.tensor_parallel_size) if self.cfg.enable_expert_parallel else [0]
        else:
            ranks = [rank]
        out = {}
        for r in ranks:
            out.update({name: _training_names(name) for name in self.state_dict(r)})
        return out
