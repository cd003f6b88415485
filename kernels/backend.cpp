// The backend factory and device queries: the one place that knows which backends this build has.
#include "fd/kernels/backend.h"

#include "fd/status.h"

#if FD_WITH_CUDA
#include "fd/kernels/cuda_backend.h"
#endif

#include <fstream>
#include <sstream>

namespace fd::kernels {

const char * device_kind_name(DeviceKind kind) {
    switch (kind) {
    case DeviceKind::cpu: return "cpu";
    case DeviceKind::cuda: return "cuda";
    }
    return "?";
}

MemInfo host_mem_info() {
    std::ifstream in("/proc/meminfo");
    std::string   line;
    MemInfo       m;
    while (std::getline(in, line)) {
        std::istringstream ss(line);
        std::string        key;
        int64_t            kib = 0;
        ss >> key >> kib;
        if (key == "MemAvailable:") { m.free_bytes = kib * 1024; }
        if (key == "MemTotal:") { m.total_bytes = kib * 1024; }
    }
    return m;
}

bool device_available(DeviceKind kind, int32_t device_id, std::string * why) {
    switch (kind) {
    case DeviceKind::cpu: return true;
    case DeviceKind::cuda:
#if FD_WITH_CUDA
        return cuda_device_available(device_id, why);
#else
        (void)device_id;
        if (why) { *why = "this build has no CUDA backend (configure with a CUDA toolkit and FD_WITH_CUDA=ON)"; }
        return false;
#endif
    }
    if (why) { *why = "unknown device kind"; }
    return false;
}

int32_t device_count(DeviceKind kind) {
    if (kind == DeviceKind::cpu) { return 1; }
#if FD_WITH_CUDA
    return cuda_device_count();
#else
    return 0;
#endif
}

MemInfo device_mem_info(DeviceKind kind, int32_t device_id) {
    std::string why;
    if (!device_available(kind, device_id, &why)) { fail(Errc::invalid_argument, "--device {}: {}", device_kind_name(kind), why); }
#if FD_WITH_CUDA
    if (kind == DeviceKind::cuda) { return cuda_mem_info(device_id); }
#endif
    return host_mem_info();
}

std::unique_ptr<Backend> make_backend(const BackendConfig & cfg) {
    switch (cfg.kind) {
    case DeviceKind::cpu: return make_cpu_backend(cfg.n_threads);
    case DeviceKind::cuda:
#if FD_WITH_CUDA
        return make_cuda_backend(cfg.device_id, cfg.n_threads, cfg.batch_invariant);
#else
        break;
#endif
    }
    fail(Errc::invalid_argument, "backend '{}' is not compiled into this build", device_kind_name(cfg.kind));
}

}  // namespace fd::kernels
