// The `rsync` load strategy (docs/weight_sources.md). STUB: to be implemented.
#include "fd/weights/weight_source.h"

#include "fd/status.h"

namespace fd::weights {

std::unique_ptr<WeightSource> make_rsync_source(std::filesystem::path model_dir, const std::string & config_json) {
    fail(Errc::invalid_argument, "--load-strategy rsync: not implemented yet");
}

}  // namespace fd::weights
