// CudaVmmAllocator (see fd/kernels/cuda_vmm_allocator.h): per-tag reserved address ranges backed
// by physical chunks that release / reacquire unmap and remap at the same addresses.
#include "fd/kernels/cuda_vmm_allocator.h"

#include "fd/status.h"

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <algorithm>

namespace fd::kernels::cuda {

namespace {

void check_cu(CUresult r, const char * call, std::string_view what) {
    if (r == CUDA_SUCCESS) { return; }
    const char * name = nullptr;
    const char * text = nullptr;
    cuGetErrorName(r, &name);
    cuGetErrorString(r, &text);
    fail(Errc::internal, "CUDA VMM allocator: {} failed for {}: {} ({})", call, what, name ? name : "?", text ? text : "?");
}

size_t round_up(size_t n, size_t g) { return (n + g - 1) / g * g; }

CUmemAllocationProp device_prop(int cu_device) {
    CUmemAllocationProp prop{};
    prop.type          = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id   = cu_device;
    return prop;
}

}  // namespace

std::string_view mem_tag_name(MemTag tag) {
    switch (tag) {
        case MemTag::weight: return "weight";
        case MemTag::kv_cache: return "kv_cache";
        case MemTag::staging: return "staging";
        case MemTag::kv_swap: return "kv_swap";
    }
    return "?";
}

CudaVmmAllocator::CudaVmmAllocator(int device, size_t chunk_bytes) : device_(device) {
    const cudaError_t e = cudaSetDevice(device);
    if (e != cudaSuccess) { fail(Errc::internal, "CUDA VMM allocator: cudaSetDevice({}): {}", device, cudaGetErrorString(e)); }
    cudaFree(nullptr);  // creates the runtime's primary context and makes it current
    check_cu(cuInit(0), "cuInit", "the driver");
    CUdevice dev = 0;
    check_cu(cuDeviceGet(&dev, device), "cuDeviceGet", "the device");
    cu_device_ = dev;
    int vmm = 0;
    check_cu(cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev), "cuDeviceGetAttribute",
             "virtual memory support");
    if (!vmm) { fail(Errc::internal, "CUDA VMM allocator: device {} does not support virtual memory management", device); }
    const CUmemAllocationProp prop = device_prop(cu_device_);
    check_cu(cuMemGetAllocationGranularity(&granularity_, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
             "cuMemGetAllocationGranularity", "the device");
    chunk_bytes_ = round_up(chunk_bytes == 0 ? granularity_ : chunk_bytes, granularity_);
}

CudaVmmAllocator::~CudaVmmAllocator() {
    for (Tag & t : tags_) {
        if (t.base == 0) { continue; }
        try {
            unmap_all(t);
        } catch (...) {  // a destructor must not throw; the process is tearing the context down
        }
        cuMemAddressFree(t.base, t.size);
        t = Tag{};
    }
}

void * CudaVmmAllocator::create(MemTag tag, size_t bytes) {
    Tag & t = tags_[index(tag)];
    if (t.base != 0) { fail(Errc::invalid_argument, "CUDA VMM allocator: tag {} already has memory", mem_tag_name(tag)); }
    if (bytes == 0) { fail(Errc::invalid_argument, "CUDA VMM allocator: tag {}: zero bytes requested", mem_tag_name(tag)); }
    Tag fresh;
    fresh.size = round_up(bytes, granularity_);
    for (size_t off = 0; off < fresh.size; off += chunk_bytes_) {
        fresh.chunk_sizes.push_back(std::min(chunk_bytes_, fresh.size - off));
    }
    CUdeviceptr base = 0;
    check_cu(cuMemAddressReserve(&base, fresh.size, granularity_, 0, 0), "cuMemAddressReserve", mem_tag_name(tag));
    fresh.base = base;
    try {
        map_all(fresh, tag);
    } catch (...) {
        cuMemAddressFree(fresh.base, fresh.size);
        throw;
    }
    t = std::move(fresh);
    return reinterpret_cast<void *>(t.base);
}

size_t CudaVmmAllocator::release(MemTag tag) {
    Tag & t = tags_[index(tag)];
    if (t.base == 0) { fail(Errc::invalid_argument, "CUDA VMM allocator: tag {} was never created", mem_tag_name(tag)); }
    if (t.handles.empty()) { return 0; }
    // Kernels still running on the memory must finish before it is unmapped.
    const cudaError_t e = cudaDeviceSynchronize();
    if (e != cudaSuccess) { fail(Errc::internal, "CUDA VMM allocator: release {}: cudaDeviceSynchronize: {}", mem_tag_name(tag), cudaGetErrorString(e)); }
    unmap_all(t);
    return t.size;
}

void CudaVmmAllocator::reacquire(MemTag tag) {
    Tag & t = tags_[index(tag)];
    if (t.base == 0) { fail(Errc::invalid_argument, "CUDA VMM allocator: tag {} was never created", mem_tag_name(tag)); }
    if (!t.handles.empty()) { return; }
    map_all(t, tag);
}

void CudaVmmAllocator::map_all(Tag & t, MemTag tag) {
    const CUmemAllocationProp prop = device_prop(cu_device_);
    std::vector<unsigned long long> handles;
    size_t                          off = 0;
    auto undo = [&] {
        size_t o = 0;
        for (size_t i = 0; i < handles.size(); ++i) {
            if (o < off) { cuMemUnmap(t.base + o, t.chunk_sizes[i]); }
            cuMemRelease(handles[i]);
            o += t.chunk_sizes[i];
        }
    };
    try {
        for (size_t i = 0; i < t.chunk_sizes.size(); ++i) {
            CUmemGenericAllocationHandle h = 0;
            check_cu(cuMemCreate(&h, t.chunk_sizes[i], &prop, 0), "cuMemCreate", mem_tag_name(tag));
            handles.push_back(h);
            check_cu(cuMemMap(t.base + off, t.chunk_sizes[i], 0, h, 0), "cuMemMap", mem_tag_name(tag));
            off += t.chunk_sizes[i];
        }
        CUmemAccessDesc access{};
        access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        access.location.id   = cu_device_;
        access.flags         = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        check_cu(cuMemSetAccess(t.base, t.size, &access, 1), "cuMemSetAccess", mem_tag_name(tag));
    } catch (...) {
        undo();
        throw;
    }
    t.handles = std::move(handles);
}

void CudaVmmAllocator::unmap_all(Tag & t) {
    size_t off = 0;
    for (size_t i = 0; i < t.handles.size(); ++i) {
        check_cu(cuMemUnmap(t.base + off, t.chunk_sizes[i]), "cuMemUnmap", "a chunk");
        check_cu(cuMemRelease(t.handles[i]), "cuMemRelease", "a chunk");
        off += t.chunk_sizes[i];
    }
    t.handles.clear();
}

}  // namespace fd::kernels::cuda
