// The `ipc_snapshot` load strategy (docs/weight_sources.md). STUB: to be implemented.
#include "fd/weights/weight_source.h"

#include "fd/status.h"

namespace fd::weights {

std::unique_ptr<WeightSource> make_ipc_snapshot_source(std::filesystem::path model_dir) {
    fail(Errc::invalid_argument, "--load-strategy ipc_snapshot: not implemented yet");
}

}  // namespace fd::weights
