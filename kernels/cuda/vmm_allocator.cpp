// CudaVmmAllocator (see fd/kernels/cuda_vmm_allocator.h): per-tag reserved address ranges backed
// by physical chunks that release / reacquire unmap and remap at the same addresses.
#include "fd/kernels/cuda_vmm_allocator.h"

#include "fd/status.h"

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <algorithm>

namespace fd::kernels::cuda {

namespace {

/// The driver calls, resolved through the CUDA runtime (cudaGetDriverEntryPointByVersion) so no
/// binary links libcuda.so.1: a machine without the driver still runs them (and the GPU tests
/// skip) instead of failing to load.
struct Driver {
    decltype(&::cuGetErrorName)                 get_error_name     = nullptr;
    decltype(&::cuGetErrorString)               get_error_string   = nullptr;
    decltype(&::cuDeviceGet)                    device_get         = nullptr;
    decltype(&::cuDeviceGetAttribute)           device_attribute   = nullptr;
    decltype(&::cuMemGetAllocationGranularity)  granularity        = nullptr;
    decltype(&::cuMemAddressReserve)            address_reserve    = nullptr;
    decltype(&::cuMemAddressFree)               address_free       = nullptr;
    decltype(&::cuMemCreate)                    create             = nullptr;
    decltype(&::cuMemRelease)                   release            = nullptr;
    decltype(&::cuMemMap)                       map                = nullptr;
    decltype(&::cuMemUnmap)                     unmap              = nullptr;
    decltype(&::cuMemSetAccess)                 set_access         = nullptr;
};

template <typename F>
void resolve(F & fn, const char * symbol) {
    void *                           p      = nullptr;
    cudaDriverEntryPointQueryResult  status = cudaDriverEntryPointSymbolNotFound;
    const cudaError_t                e      = cudaGetDriverEntryPointByVersion(symbol, &p, 12000, cudaEnableDefault, &status);
    if (e != cudaSuccess || status != cudaDriverEntryPointSuccess || p == nullptr) {
        fail(Errc::internal, "CUDA VMM allocator: driver entry point {} not found ({})", symbol,
             e != cudaSuccess ? cudaGetErrorString(e) : "driver too old?");
    }
    fn = reinterpret_cast<F>(p);
}

const Driver & driver() {
    static const Driver d = [] {
        Driver x;
        resolve(x.get_error_name, "cuGetErrorName");
        resolve(x.get_error_string, "cuGetErrorString");
        resolve(x.device_get, "cuDeviceGet");
        resolve(x.device_attribute, "cuDeviceGetAttribute");
        resolve(x.granularity, "cuMemGetAllocationGranularity");
        resolve(x.address_reserve, "cuMemAddressReserve");
        resolve(x.address_free, "cuMemAddressFree");
        resolve(x.create, "cuMemCreate");
        resolve(x.release, "cuMemRelease");
        resolve(x.map, "cuMemMap");
        resolve(x.unmap, "cuMemUnmap");
        resolve(x.set_access, "cuMemSetAccess");
        return x;
    }();
    return d;
}

void check_cu(CUresult r, const char * call, std::string_view what) {
    if (r == CUDA_SUCCESS) { return; }
    const char * name = nullptr;
    const char * text = nullptr;
    driver().get_error_name(r, &name);
    driver().get_error_string(r, &text);
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
    const cudaError_t ctx = cudaFree(nullptr);  // creates the runtime's primary context and makes it current
    if (ctx != cudaSuccess) { fail(Errc::internal, "CUDA VMM allocator: device {}: {}", device, cudaGetErrorString(ctx)); }
    CUdevice dev = 0;
    check_cu(driver().device_get(&dev, device), "cuDeviceGet", "the device");
    cu_device_ = dev;
    int vmm = 0;
    check_cu(driver().device_attribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev), "cuDeviceGetAttribute",
             "virtual memory support");
    if (!vmm) { fail(Errc::internal, "CUDA VMM allocator: device {} does not support virtual memory management", device); }
    const CUmemAllocationProp prop = device_prop(cu_device_);
    check_cu(driver().granularity(&granularity_, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
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
        driver().address_free(t.base, t.size);
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
    check_cu(driver().address_reserve(&base, fresh.size, granularity_, 0, 0), "cuMemAddressReserve", mem_tag_name(tag));
    fresh.base = base;
    try {
        map_all(fresh, tag);
    } catch (...) {
        driver().address_free(fresh.base, fresh.size);
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
            if (o < off) { driver().unmap(t.base + o, t.chunk_sizes[i]); }
            driver().release(handles[i]);
            o += t.chunk_sizes[i];
        }
    };
    try {
        for (size_t i = 0; i < t.chunk_sizes.size(); ++i) {
            CUmemGenericAllocationHandle h = 0;
            check_cu(driver().create(&h, t.chunk_sizes[i], &prop, 0), "cuMemCreate", mem_tag_name(tag));
            handles.push_back(h);
            check_cu(driver().map(t.base + off, t.chunk_sizes[i], 0, h, 0), "cuMemMap", mem_tag_name(tag));
            off += t.chunk_sizes[i];
        }
        CUmemAccessDesc access{};
        access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        access.location.id   = cu_device_;
        access.flags         = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        check_cu(driver().set_access(t.base, t.size, &access, 1), "cuMemSetAccess", mem_tag_name(tag));
    } catch (...) {
        undo();
        throw;
    }
    t.handles = std::move(handles);
}

void CudaVmmAllocator::unmap_all(Tag & t) {
    size_t off = 0;
    for (size_t i = 0; i < t.handles.size(); ++i) {
        check_cu(driver().unmap(t.base + off, t.chunk_sizes[i]), "cuMemUnmap", "a chunk");
        check_cu(driver().release(t.handles[i]), "cuMemRelease", "a chunk");
        off += t.chunk_sizes[i];
    }
    t.handles.clear();
}

}  // namespace fd::kernels::cuda
