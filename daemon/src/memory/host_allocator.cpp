// HostAllocator: one fd::Arena (anonymous private mmap) per tag. release() drops the pages and
// keeps the mapping (MADV_DONTNEED), so reacquire() hands back zeroed memory at the same address.
#include "fd/arena.h"
#include "fd/memory/allocator.h"
#include "fd/status.h"

#include <array>
#include <utility>

namespace fd::memory {
namespace {

class HostAllocator final : public Allocator {
public:
    HostAllocator()
        : regions_{Region{Arena("weight")}, Region{Arena("kv_cache")}, Region{Arena("staging")}, Region{Arena("kv_swap")},
                   Region{Arena("mtp_cache")}, Region{Arena("ep_buffer")}} {}

    const char * name() const override { return "host"; }
    kernels::DeviceKind device() const override { return kernels::DeviceKind::cpu; }
    bool keeps_addresses() const override { return true; }

    std::byte * map(Tag tag, int64_t bytes, bool populate) override {
        if (bytes <= 0) { fail(Errc::invalid_argument, "allocator: region of {} bytes for tag {}", bytes, tag_name(tag)); }
        Region & r = at(tag);
        r.resident = false;
        r.arena.reserve(bytes, populate);  // unmaps the old region first; throws (nothing mapped) when out of memory
        r.resident = true;
        return r.arena.data();
    }

    int64_t release(Tag tag) noexcept override {
        Region & r = at(tag);
        if (!r.resident) { return 0; }
        r.resident = false;
        return r.arena.discard_pages();
    }

    std::byte * reacquire(Tag tag, bool populate) override {
        Region & r = at(tag);
        FD_CHECK(r.arena.mapped(), "allocator: reacquire of tag {}, which has no region", tag_name(tag));
        if (!r.resident) {
            if (populate) { r.arena.populate(); }
            r.resident = true;
        }
        return r.arena.data();
    }

    void swap(Tag a, Tag b) noexcept override {
        Region & ra = at(a);
        Region & rb = at(b);
        ra.arena.swap_mapping(rb.arena);
        std::swap(ra.resident, rb.resident);
    }

    int64_t drop(Tag tag) noexcept override {
        Region & r = at(tag);
        const int64_t freed = r.resident ? r.arena.capacity_bytes() : 0;
        r.arena.release();
        r.resident = false;
        return freed;
    }

    std::byte * data(Tag tag) const override { return at(tag).arena.data(); }
    int64_t capacity_bytes(Tag tag) const override { return at(tag).arena.capacity_bytes(); }
    bool resident(Tag tag) const override { return at(tag).resident; }

private:
    struct Region {
        Arena arena;
        bool  resident = false;
    };
    Region & at(Tag tag) { return regions_[static_cast<size_t>(tag)]; }
    const Region & at(Tag tag) const { return regions_[static_cast<size_t>(tag)]; }

    std::array<Region, kNumTags> regions_;
};

}  // namespace

std::unique_ptr<Allocator> make_host_allocator() { return std::make_unique<HostAllocator>(); }

}  // namespace fd::memory
