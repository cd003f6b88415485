"""fdrollout: the trainer side of the fdrollout rollout engine (SPEC §12).

- `Client(url, api_key=None, timeout=900)`: every weight-control call of one daemon
  (pause modes, resume, sleep/wakeup by tag, update_weights, two-phase stage/commit/drop, abort,
  health) over its V1 HTTP API; errors raise `FdRolloutError` with the daemon's error type.
  `Client.weight_stream(version)`: stream new weights into the daemon without files
  (`WeightStream`: send(name, tensor); leaving commits on every rank, an exception drops);
  `weight_stream(version, base_version=...)` with `send_delta(name, indices, values)` sends
  only changed elements (`changed_elements(old, new)` finds them).
- `Fleet(urls)`: the same calls on several daemons in parallel, and the all-or-nothing fleet
  update (`FleetError` says what was committed where).
- `publish`: write weights for the rsync, ipc_snapshot and ipc load strategies (numpy only),
  rsync delta versions and ipc delta records too (`publish_rsync_delta`, `publish_ipc_delta`);
  `safetensors_np`: the numpy safetensors reader/writer it uses.
- `RolloutModelConfig` / `RolloutModel`: the rollout's state dict per rank and its mapping to
  training names (the seed's `fastdeploy.rl` API).

Needs Debian's python3 with python3-numpy (for publish / RolloutModel); torch is never required.
From a checkout: `PYTHONPATH=python`; `cmake --install` puts the package on python3's path.
"""
from .client import Client, FdRolloutError
from .fleet import Fleet, FleetError, read_fleet_file
from .rollout_model import RolloutModel, RolloutModelConfig
from .weight_stream import WeightStream, changed_elements

__all__ = ["Client", "FdRolloutError", "Fleet", "FleetError", "read_fleet_file", "RolloutModel",
           "RolloutModelConfig", "WeightStream", "changed_elements"]
__version__ = "0.1.0"
