// The backend factory: the one place that knows which backends this build has.
#include "fd/kernels/backend.h"

#include "fd/status.h"

#if FD_WITH_CUDA
#include "fd/kernels/cuda_backend.h"
#endif

namespace fd::kernels {

const char * device_kind_name(DeviceKind kind) {
    switch (kind) {
    case DeviceKind::cpu: return "cpu";
    case DeviceKind::cuda: return "cuda";
    }
    return "?";
}

std::unique_ptr<Backend> make_backend(const BackendConfig & cfg) {
    switch (cfg.kind) {
    case DeviceKind::cpu: return make_cpu_backend(cfg.n_threads);
    case DeviceKind::cuda:
#if FD_WITH_CUDA
        return make_cuda_backend(cfg.device_id, cfg.n_threads);
#else
        break;
#endif
    }
    fail(Errc::invalid_argument, "backend '{}' is not compiled into this build", device_kind_name(cfg.kind));
}

}  // namespace fd::kernels
