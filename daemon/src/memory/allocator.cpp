// Tag names and the allocator factory (the one place that knows which allocators this build has).
#include "fd/memory/allocator.h"

#if FD_WITH_CUDA
#include "fd/memory/cuda_vmm_allocator.h"
#endif

#include "fd/status.h"

namespace fd::memory {

const char * tag_name(Tag tag) {
    switch (tag) {
    case Tag::weight: return "weight";
    case Tag::kv_cache: return "kv_cache";
    case Tag::staging: return "staging";
    case Tag::kv_swap: return "kv_swap";
    case Tag::mtp_cache: return "mtp_cache";
    case Tag::ep_buffer: return "ep_buffer";
    }
    return "?";
}

std::optional<Tag> parse_tag(std::string_view name) {
    for (Tag t : kAllTags) {
        if (name == tag_name(t)) { return t; }
    }
    return std::nullopt;
}

int64_t Allocator::held_bytes_total() const {
    int64_t sum = 0;
    for (Tag t : kAllTags) { sum += held_bytes(t); }
    return sum;
}

std::unique_ptr<Allocator> make_allocator(kernels::DeviceKind device, int32_t device_id) {
    switch (device) {
    case kernels::DeviceKind::cpu: return make_host_allocator();
    case kernels::DeviceKind::cuda:
#if FD_WITH_CUDA
        return make_cuda_vmm_allocator(device_id);  // -1: the calling thread's current CUDA device
#else
        (void)device_id;
        break;
#endif
    }
    fail(Errc::invalid_argument, "no allocator for device '{}' in this build", kernels::device_kind_name(device));
}

}  // namespace fd::memory
