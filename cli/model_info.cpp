// fdctl model-info: RolloutModel's state dict and name mappings (STUB).
#include "offline.h"

#include "fd/status.h"

namespace fdctl {

int run_model_info(const ModelInfoOptions & o) {
    fd::fail(fd::Errc::invalid_argument, "model-info: not implemented yet");
}

}  // namespace fdctl
