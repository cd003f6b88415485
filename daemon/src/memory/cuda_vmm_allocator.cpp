// CudaVmmAllocator (see fd/memory/cuda_vmm_allocator.h): per-tag reserved address ranges backed by
// physical chunks that release / reacquire unmap and remap at the same addresses.
#include "fd/memory/cuda_vmm_allocator.h"

#include "fd/log.h"
#include "fd/status.h"

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <utility>
#include <vector>

namespace fd::memory {

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

void check_rt(cudaError_t e, const char * call, std::string_view what) {
    if (e != cudaSuccess) { fail(Errc::internal, "CUDA VMM allocator: {} failed for {}: {}", call, what, cudaGetErrorString(e)); }
}

/// The device ordinal's CUdevice, with the runtime's primary context current.
CUdevice bind_device(int device) {
    check_rt(cudaSetDevice(device), "cudaSetDevice", "the device");
    check_rt(cudaFree(nullptr), "cudaFree(nullptr)", "the primary context");  // creates it and makes it current
    CUdevice dev = 0;
    check_cu(driver().device_get(&dev, device), "cuDeviceGet", "the device");
    int vmm = 0;
    check_cu(driver().device_attribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev),
             "cuDeviceGetAttribute", "virtual memory support");
    if (!vmm) { fail(Errc::internal, "CUDA VMM allocator: device {} does not support virtual memory management", device); }
    return dev;
}

size_t granularity_of(CUdevice dev) {
    const CUmemAllocationProp prop = device_prop(dev);
    size_t                    g    = 0;
    check_cu(driver().granularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM), "cuMemGetAllocationGranularity", "the device");
    return g;
}

int current_if_negative(int device) {
    if (device >= 0) { return device; }
    int cur = 0;
    check_rt(cudaGetDevice(&cur), "cudaGetDevice", "the current device");
    return cur;
}

class CudaVmmAllocator final : public Allocator {
public:
    CudaVmmAllocator(int device, int64_t chunk_bytes) : device_(current_if_negative(device)), cu_device_(bind_device(device_)) {
        granularity_ = granularity_of(cu_device_);
        chunk_bytes_ = round_up(chunk_bytes <= 0 ? granularity_ : static_cast<size_t>(chunk_bytes), granularity_);
    }
    ~CudaVmmAllocator() override {
        for (Tag t : kAllTags) { drop(t); }
    }

    const char *        name() const override { return "cuda_vmm"; }
    kernels::DeviceKind device() const override { return kernels::DeviceKind::cuda; }
    bool                keeps_addresses() const override { return true; }

    std::byte * map(Tag tag, int64_t bytes, bool populate) override {
        if (tag == Tag::kv_swap) {
            unpin();
            std::byte * p = host_->map(tag, bytes, /*populate=*/true);  // page-locking touches every page anyway
            pin();
            return p;
        }
        (void)populate;  // device memory is physical once mapped
        if (bytes <= 0) { fail(Errc::invalid_argument, "CUDA VMM allocator: tag {}: {} bytes requested", tag_name(tag), bytes); }
        drop(tag);
        Region r;
        r.size = round_up(static_cast<size_t>(bytes), granularity_);
        for (size_t off = 0; off < r.size; off += chunk_bytes_) { r.chunks.push_back(std::min(chunk_bytes_, r.size - off)); }
        CUdeviceptr base = 0;
        check_cu(driver().address_reserve(&base, r.size, granularity_, 0, 0), "cuMemAddressReserve", tag_name(tag));
        r.base = base;
        try {
            map_all(r, tag);
        } catch (...) {
            driver().address_free(r.base, r.size);
            throw;
        }
        regions_[idx(tag)] = std::move(r);
        return data(tag);
    }

    int64_t release(Tag tag) noexcept override {
        if (tag == Tag::kv_swap) {
            unpin();
            return host_->release(tag);
        }
        Region & r = regions_[idx(tag)];
        if (r.base == 0 || r.handles.empty()) { return 0; }
        // Kernels still using the memory must finish before it is unmapped.
        const cudaError_t e = cudaDeviceSynchronize();
        if (e != cudaSuccess) {
            log::get("memory")->error("CUDA VMM allocator: release {}: cudaDeviceSynchronize: {}", tag_name(tag), cudaGetErrorString(e));
        }
        unmap_all(r, tag);
        return static_cast<int64_t>(r.size);
    }

    std::byte * reacquire(Tag tag, bool populate) override {
        if (tag == Tag::kv_swap) {
            std::byte * p = host_->reacquire(tag, /*populate=*/true);
            if (!pinned_) { pin(); }
            return p;
        }
        (void)populate;
        Region & r = regions_[idx(tag)];
        if (r.base == 0) { fail(Errc::internal, "CUDA VMM allocator: reacquire {}: the tag has no region", tag_name(tag)); }
        if (r.handles.empty()) { map_all(r, tag); }
        return data(tag);
    }

    void swap(Tag a, Tag b) noexcept override {
        if (a == b) { return; }
        if (a == Tag::kv_swap || b == Tag::kv_swap) {  // host memory never trades places with device memory
            log::get("memory")->error("CUDA VMM allocator: swap({}, {}) refused: kv_swap is host memory", tag_name(a), tag_name(b));
            return;
        }
        std::swap(regions_[idx(a)], regions_[idx(b)]);
    }

    int64_t drop(Tag tag) noexcept override {
        if (tag == Tag::kv_swap) {
            unpin();
            return host_->drop(tag);
        }
        Region &      r     = regions_[idx(tag)];
        const int64_t freed = release(tag);
        if (r.base != 0) { driver().address_free(r.base, r.size); }
        r = Region{};
        return freed;
    }

    std::byte * data(Tag tag) const override {
        return tag == Tag::kv_swap ? host_->data(tag) : reinterpret_cast<std::byte *>(regions_[idx(tag)].base);
    }
    int64_t capacity_bytes(Tag tag) const override {
        return tag == Tag::kv_swap ? host_->capacity_bytes(tag) : static_cast<int64_t>(regions_[idx(tag)].size);
    }
    bool resident(Tag tag) const override { return tag == Tag::kv_swap ? host_->resident(tag) : !regions_[idx(tag)].handles.empty(); }

private:
    struct Region {
        CUdeviceptr                               base = 0;
        size_t                                    size = 0;
        std::vector<size_t>                       chunks;   // sizes, in address order
        std::vector<CUmemGenericAllocationHandle> handles;  // empty = released
    };
    static int idx(Tag tag) { return static_cast<int>(tag); }

    /// cuMemCreate + cuMemMap every chunk, cuMemSetAccess, zero-fill. On failure undoes its own
    /// work (the region stays released) and throws.
    void map_all(Region & r, Tag tag) {
        const CUmemAllocationProp                 prop = device_prop(cu_device_);
        std::vector<CUmemGenericAllocationHandle> handles;
        size_t                                    mapped = 0;
        try {
            for (size_t i = 0; i < r.chunks.size(); ++i) {
                CUmemGenericAllocationHandle h = 0;
                check_cu(driver().create(&h, r.chunks[i], &prop, 0), "cuMemCreate", tag_name(tag));
                handles.push_back(h);
                check_cu(driver().map(r.base + mapped, r.chunks[i], 0, h, 0), "cuMemMap", tag_name(tag));
                mapped += r.chunks[i];
            }
            CUmemAccessDesc access{};
            access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
            access.location.id   = cu_device_;
            access.flags         = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
            check_cu(driver().set_access(r.base, r.size, &access, 1), "cuMemSetAccess", tag_name(tag));
            check_rt(cudaMemset(reinterpret_cast<void *>(r.base), 0, r.size), "cudaMemset", tag_name(tag));
            check_rt(cudaDeviceSynchronize(), "cudaDeviceSynchronize", tag_name(tag));
        } catch (...) {
            size_t off = 0;
            for (size_t i = 0; i < handles.size(); ++i) {
                if (off < mapped) { driver().unmap(r.base + off, r.chunks[i]); }
                driver().release(handles[i]);
                off += r.chunks[i];
            }
            throw;
        }
        r.handles = std::move(handles);
    }

    /// cuMemUnmap + cuMemRelease every chunk; failures are logged (release cannot fail).
    void unmap_all(Region & r, Tag tag) noexcept {
        size_t off = 0;
        for (size_t i = 0; i < r.handles.size(); ++i) {
            const CUresult u = driver().unmap(r.base + off, r.chunks[i]);
            const CUresult f = driver().release(r.handles[i]);
            if (u != CUDA_SUCCESS || f != CUDA_SUCCESS) {
                log::get("memory")->error("CUDA VMM allocator: releasing chunk {} of {} failed (unmap {}, release {})", i,
                                          tag_name(tag), static_cast<int>(u), static_cast<int>(f));
            }
            off += r.chunks[i];
        }
        r.handles.clear();
    }

    /// Page-lock the resident kv_swap host region (cudaHostRegister) so swap copies are DMA.
    void pin() {
        if (!host_->resident(Tag::kv_swap)) { return; }
        check_rt(cudaHostRegister(host_->data(Tag::kv_swap), static_cast<size_t>(host_->capacity_bytes(Tag::kv_swap)),
                                  cudaHostRegisterDefault),
                 "cudaHostRegister", "kv_swap");
        pinned_ = true;
    }
    void unpin() noexcept {
        if (!pinned_) { return; }
        const cudaError_t e = cudaHostUnregister(host_->data(Tag::kv_swap));
        if (e != cudaSuccess) { log::get("memory")->error("CUDA VMM allocator: cudaHostUnregister(kv_swap): {}", cudaGetErrorString(e)); }
        pinned_ = false;
    }

    std::unique_ptr<Allocator> host_ = make_host_allocator();  ///< the kv_swap region (pinned host memory)
    bool     pinned_      = false;  ///< kv_swap is registered with CUDA
    int      device_      = 0;
    CUdevice cu_device_   = 0;
    size_t   granularity_ = 0;
    size_t   chunk_bytes_ = 0;
    Region   regions_[kNumTags];
};

}  // namespace

std::unique_ptr<Allocator> make_cuda_vmm_allocator(int device, int64_t chunk_bytes) {
    return std::make_unique<CudaVmmAllocator>(device, chunk_bytes);
}

int64_t cuda_vmm_granularity(int device) { return static_cast<int64_t>(granularity_of(bind_device(current_if_negative(device)))); }

}  // namespace fd::memory
