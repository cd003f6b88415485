// cli/offline.h — fdctl subcommands that work on files and shared memory, without a daemon:
// trainer-side publishing (SPEC §5) and the rollout's state dict (RolloutModel).
#pragma once

#include <string>

namespace fdctl {

struct PublishOptions {
    std::string strategy;        ///< rsync | ipc_snapshot | ipc
    std::string from;            ///< a Hugging Face checkpoint dir (HF names)
    std::string store;           ///< rsync: the store dir
    std::string model_dir;       ///< ipc_snapshot: the rollout's --model dir (files land there)
    std::string version;         ///< rsync, ipc, ipc_delta: the version to publish
    std::string base_from;       ///< ipc_delta: the Hugging Face checkpoint dir of base_version
    std::string base_version;    ///< ipc_delta: the version the delta applies to
    int         tp   = 1;        ///< ipc_snapshot, ipc: tensor parallel size of the rollout
    bool        tp_given = false;///< --tp was on the command line (ipc: else the running rollout's is used)
    int         rollout_tp = 0;  ///< ipc: the tensor_parallel_size the daemon on --port reports (0: none answered)
    bool        ep = false;      ///< ipc_snapshot, ipc: --ep (--enable-expert-parallel): cut each rank's experts whole
    bool        ep_given = false;///< --ep was on the command line (ipc: else the running rollout's is used)
    int         rollout_ep = 0;  ///< ipc: the expert_parallel_size the daemon on --port reports (0: none answered)
    int         port = 8000;     ///< ipc: the rollout's --port (names the shm records)
    bool        json  = false;
    bool        quiet = false;
};

/// `fdctl publish`: write one version atomically (docs/weight_sources.md). Returns the exit code.
/// Dispatches to one of the three below (each in its own file).
int run_publish(const PublishOptions & o);
int publish_rsync(const PublishOptions & o);          ///< cli/publish_rsync.cpp
int publish_ipc_snapshot(const PublishOptions & o);   ///< cli/publish_ipc.cpp
int publish_ipc(const PublishOptions & o);            ///< cli/publish_ipc.cpp
/// The elements of --from that differ from --base-from's, into the port's ipc delta record
/// (docs/weight_streams.md "Over ipc publishes"). cli/publish_ipc_delta.cpp.
int publish_ipc_delta(const PublishOptions & o);

struct ModelInfoOptions {
    std::string model_dir;
    int         tp   = 1;
    bool        ep   = false;  ///< --ep / --enable-expert-parallel: the daemon's expert-parallel layout (ep = tp)
    bool        json = false;
    std::string kv_cache_dtype = "auto";  ///< the daemon's --kv-cache-dtype: auto | float32 | bfloat16 (sizes kv_cache)
    std::string compute_dtype = "float32";  ///< the daemon's --compute-dtype the numerics block describes
};

/// `fdctl model-info`: the inference state dict per rank and the names it maps to in training.
int run_model_info(const ModelInfoOptions & o);

}  // namespace fdctl
