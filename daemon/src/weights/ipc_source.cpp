// The `ipc` load strategy (docs/weight_sources.md). STUB: to be implemented.
#include "fd/weights/weight_source.h"

#include "fd/status.h"

namespace fd::weights {

std::unique_ptr<WeightSource> make_ipc_source(int port) {
    fail(Errc::invalid_argument, "--load-strategy ipc: not implemented yet");
}

}  // namespace fd::weights
