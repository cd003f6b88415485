// The tagged allocator (daemon/src/memory/): HostAllocator regions per tag, release drops only
// that tag's pages (the kernel's own accounting: mincore() per region, VmRSS for the process),
// reacquire gives zeroed, usable memory at the same address, bytes per tag, swap, bad input.
#include "fd/arena.h"
#include "fd/memory/allocator.h"
#include "fd/status.h"

#include <doctest/doctest.h>

#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <vector>

using fd::memory::Tag;

namespace {

/// Bytes of [p, p + bytes) resident in RAM, as the kernel reports it (mincore).
int64_t resident_bytes(const std::byte * p, int64_t bytes) {
    const int64_t page = sysconf(_SC_PAGESIZE);
    std::vector<unsigned char> vec(static_cast<size_t>((bytes + page - 1) / page));
    REQUIRE(mincore(const_cast<std::byte *>(p), static_cast<size_t>(bytes), vec.data()) == 0);
    int64_t n = 0;
    for (unsigned char c : vec) { n += (c & 1) ? page : 0; }
    return n;
}

void fill(std::byte * p, int64_t bytes, unsigned char value) { std::memset(p, value, static_cast<size_t>(bytes)); }

bool all_equal(const std::byte * p, int64_t bytes, unsigned char value) {
    for (int64_t i = 0; i < bytes; ++i) {
        if (p[i] != std::byte{value}) { return false; }
    }
    return true;
}

}  // namespace

TEST_SUITE("memory") {

TEST_CASE("tag names round-trip and unknown names are refused") {
    for (Tag t : fd::memory::kAllTags) { CHECK(fd::memory::parse_tag(fd::memory::tag_name(t)) == t); }
    CHECK(std::string(fd::memory::tag_name(Tag::kv_swap)) == "kv_swap");
    CHECK_FALSE(fd::memory::parse_tag("weights").has_value());
    CHECK_FALSE(fd::memory::parse_tag("").has_value());
}

TEST_CASE("host allocator: release drops the RSS of that tag only, reacquire gives zeroed memory at the same address") {
    auto a = fd::memory::make_host_allocator();
    CHECK(a->keeps_addresses());
    CHECK(a->device() == fd::kernels::DeviceKind::cpu);
    const int64_t wbytes = int64_t(64) << 20, kbytes = int64_t(32) << 20;
    const int64_t rss0 = fd::process_rss_bytes();
    REQUIRE(rss0 > 0);
    std::byte * w  = a->map(Tag::weight, wbytes, /*populate=*/false);
    std::byte * kv = a->map(Tag::kv_cache, kbytes, /*populate=*/true);
    REQUIRE(w != nullptr);
    REQUIRE(kv != nullptr);
    CHECK(reinterpret_cast<uintptr_t>(w) % 64 == 0);
    CHECK(a->capacity_bytes(Tag::weight) == wbytes);  // 2 MiB multiples stay as asked
    CHECK(a->capacity_bytes(Tag::kv_cache) == kbytes);
    CHECK(resident_bytes(kv, kbytes) == kbytes);      // populate pre-faults every page
    CHECK(all_equal(kv, kbytes, 0));
    fill(w, wbytes, 0xab);
    fill(kv, kbytes, 0xcd);
    CHECK(resident_bytes(w, wbytes) == wbytes);
    CHECK(a->held_bytes(Tag::weight) == wbytes);
    CHECK(a->held_bytes(Tag::kv_cache) == kbytes);
    CHECK(a->held_bytes(Tag::staging) == 0);
    CHECK(a->held_bytes_total() == wbytes + kbytes);
    const int64_t rss_full = fd::process_rss_bytes();
    CHECK(rss_full - rss0 >= (wbytes + kbytes) * 9 / 10);

    // Release the weights: their pages go, the KV pool's stay (contents intact).
    CHECK(a->release(Tag::weight) == wbytes);
    CHECK_FALSE(a->resident(Tag::weight));
    CHECK(a->held_bytes(Tag::weight) == 0);
    CHECK(a->capacity_bytes(Tag::weight) == wbytes);  // the size is remembered
    CHECK(a->data(Tag::weight) == w);                 // and the address range kept
    CHECK(resident_bytes(w, wbytes) == 0);
    CHECK(resident_bytes(kv, kbytes) == kbytes);
    CHECK(all_equal(kv, kbytes, 0xcd));
    CHECK(a->held_bytes_total() == kbytes);
    const int64_t rss_released = fd::process_rss_bytes();
    CAPTURE(rss0); CAPTURE(rss_full); CAPTURE(rss_released);
    CHECK(rss_full - rss_released >= wbytes * 9 / 10);
    CHECK(rss_full - rss_released <= wbytes + (int64_t(8) << 20));  // not the KV pool too
    CHECK(a->release(Tag::weight) == 0);                             // twice: nothing more to give

    // Reacquire: same address, zero-filled, usable; populate makes it resident at once.
    CHECK(a->reacquire(Tag::weight, /*populate=*/true) == w);
    CHECK(a->resident(Tag::weight));
    CHECK(resident_bytes(w, wbytes) == wbytes);
    CHECK(all_equal(w, wbytes, 0));
    fill(w, wbytes, 0x5a);
    CHECK(all_equal(w, wbytes, 0x5a));
    CHECK(a->reacquire(Tag::weight, true) == w);  // resident: a no-op that keeps the contents
    CHECK(all_equal(w, wbytes, 0x5a));

    // The KV pool the same way, without populate: pages come back on first touch.
    CHECK(a->release(Tag::kv_cache) == kbytes);
    CHECK(resident_bytes(kv, kbytes) == 0);
    CHECK(resident_bytes(w, wbytes) == wbytes);
    CHECK(a->reacquire(Tag::kv_cache, /*populate=*/false) == kv);
    CHECK(all_equal(kv, kbytes, 0));
    CHECK(a->held_bytes_total() == wbytes + kbytes);

    CHECK(a->drop(Tag::weight) == wbytes);
    CHECK(a->data(Tag::weight) == nullptr);
    CHECK(a->capacity_bytes(Tag::weight) == 0);
    CHECK(a->drop(Tag::kv_cache) == kbytes);
    CHECK(a->held_bytes_total() == 0);
}

TEST_CASE("host allocator: swap exchanges regions, residence and sizes; map replaces a region") {
    auto a = fd::memory::make_host_allocator();
    std::byte * w = a->map(Tag::weight, 1 << 20, false);
    std::byte * s = a->map(Tag::staging, 3 << 20, false);
    fill(w, 1 << 20, 1);
    fill(s, 3 << 20, 2);
    a->release(Tag::weight);
    a->swap(Tag::weight, Tag::staging);
    CHECK(a->data(Tag::weight) == s);
    CHECK(a->data(Tag::staging) == w);
    CHECK(a->resident(Tag::weight));
    CHECK_FALSE(a->resident(Tag::staging));
    CHECK(a->capacity_bytes(Tag::weight) == (4 << 20));  // 3 MiB rounded up to 2 MiB huge pages
    CHECK(a->held_bytes(Tag::staging) == 0);
    CHECK(all_equal(a->data(Tag::weight), 3 << 20, 2));
    // map() on a tag that has a region gives a fresh zeroed one of the new size.
    std::byte * w2 = a->map(Tag::weight, 5000, false);
    CHECK(a->capacity_bytes(Tag::weight) >= 5000);
    CHECK(a->capacity_bytes(Tag::weight) < (1 << 20));
    CHECK(all_equal(w2, 5000, 0));
}

TEST_CASE("host allocator: bad input is refused and changes nothing") {
    auto a = fd::memory::make_host_allocator();
    std::byte * kv = a->map(Tag::kv_cache, 1 << 16, false);
    fill(kv, 1 << 16, 7);
    try {
        a->map(Tag::kv_cache, 0, false);
        FAIL("map of 0 bytes accepted");
    } catch (const fd::Error & e) {
        CHECK(e.code() == fd::Errc::invalid_argument);
    }
    CHECK(a->data(Tag::kv_cache) == kv);
    CHECK(all_equal(kv, 1 << 16, 7));
    try {
        a->reacquire(Tag::kv_swap, false);  // never had a region
        FAIL("reacquire without a region accepted");
    } catch (const fd::Error & e) {
        CHECK(e.code() == fd::Errc::internal);
    }
    CHECK_FALSE(a->resident(Tag::kv_swap));
    CHECK(a->release(Tag::kv_swap) == 0);
    CHECK(a->drop(Tag::kv_swap) == 0);
}

TEST_CASE("make_allocator: the host allocator for the cpu device") {
    CHECK(std::string(fd::memory::make_allocator(fd::kernels::DeviceKind::cpu)->name()) == "host");
}

}  // TEST_SUITE
