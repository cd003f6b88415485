// Arena (daemon/src/arena.cpp): mmap-backed bump allocation, alignment, zero fill, capacity
// errors, and that release() really returns memory to the OS.
#include "fd/arena.h"
#include "fd/status.h"

#include <doctest/doctest.h>

#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <utility>

using fd::Arena;

TEST_SUITE("arena") {

TEST_CASE("reserve rounds up to whole pages and alloc_floats bumps 64-byte aligned blocks") {
    Arena a("test");
    CHECK_FALSE(a.mapped());
    CHECK(a.name() == "test");
    const int64_t page = sysconf(_SC_PAGESIZE);
    a.reserve(1000);
    CHECK(a.mapped());
    CHECK(a.capacity_bytes() == page);
    CHECK(a.used_bytes() == 0);
    float * p1 = a.alloc_floats(1);    // 4 bytes -> 64
    float * p2 = a.alloc_floats(17);   // 68 bytes -> 128
    float * p3 = a.alloc_floats(16);   // 64 bytes -> 64
    for (float * p : {p1, p2, p3}) { CHECK(reinterpret_cast<uintptr_t>(p) % 64 == 0); }
    CHECK(reinterpret_cast<char *>(p2) - reinterpret_cast<char *>(p1) == 64);
    CHECK(reinterpret_cast<char *>(p3) - reinterpret_cast<char *>(p2) == 128);
    CHECK(a.used_bytes() == 256);
    CHECK(Arena::footprint_floats(0) == 0);
    CHECK(Arena::footprint_floats(1) == 64);
    CHECK(Arena::footprint_floats(16) == 64);
    CHECK(Arena::footprint_floats(17) == 128);
}

TEST_CASE("allocations are zero-filled, also after release and a new reserve") {
    Arena a("zero");
    a.reserve(1 << 20);
    float * p = a.alloc_floats(1000);
    int nonzero = 0;
    for (int i = 0; i < 1000; ++i) { nonzero += p[i] != 0.0f; }
    CHECK(nonzero == 0);
    std::memset(p, 0xAB, 1000 * sizeof(float));
    a.release();
    a.reserve(1 << 20);
    float * q = a.alloc_floats(1000);
    nonzero = 0;
    for (int i = 0; i < 1000; ++i) { nonzero += q[i] != 0.0f; }
    CHECK(nonzero == 0);
}

TEST_CASE("allocating from a full or unreserved arena throws fd::Error") {
    Arena a("small");
    CHECK_THROWS_AS(a.alloc_floats(1), fd::Error);   // not reserved
    const int64_t page = sysconf(_SC_PAGESIZE);
    a.reserve(page);
    a.alloc_floats(page / 4 - 16);                   // all but the last 64 bytes
    CHECK(a.used_bytes() == page - 64);
    try {
        a.alloc_floats(17);                           // 128 bytes do not fit
        FAIL("no error");
    } catch (const fd::Error & e) {
        CHECK(e.code() == fd::Errc::internal);
        CHECK(std::string(e.what()).find("small") != std::string::npos);
    }
    CHECK(a.used_bytes() == page - 64);              // a failed alloc changes nothing
    CHECK_NOTHROW(a.alloc_floats(16));               // exactly fills the arena
    CHECK(a.used_bytes() == page);
    CHECK_THROWS_AS(a.alloc_floats(1), fd::Error);
}

TEST_CASE("release returns the capacity, resets the arena and is idempotent") {
    Arena a("rel");
    CHECK(a.release() == 0);
    a.reserve(3 << 20);  // >= 2 MiB: rounded up to whole 2 MiB huge pages
    CHECK(reinterpret_cast<uintptr_t>(a.alloc_floats(100)) % Arena::kHugePageBytes == 0);
    CHECK(a.release() == int64_t(4) << 20);
    CHECK_FALSE(a.mapped());
    CHECK(a.capacity_bytes() == 0);
    CHECK(a.used_bytes() == 0);
    CHECK(a.release() == 0);
    CHECK_THROWS_AS(a.alloc_floats(1), fd::Error);
}

TEST_CASE("moving an arena transfers the mapping") {
    Arena a("src");
    a.reserve(1 << 16);
    float * p = a.alloc_floats(4);
    p[0] = 3.5f;
    Arena b(std::move(a));
    CHECK_FALSE(a.mapped());
    CHECK(b.mapped());
    CHECK(b.used_bytes() == 64);
    CHECK(b.name() == "src");
    Arena c("dst");
    c.reserve(1 << 16);
    c = std::move(b);
    CHECK(c.name() == "src");
    CHECK(c.capacity_bytes() == 1 << 16);
    CHECK(p[0] == 3.5f);                              // still the same live mapping
}

TEST_CASE("touching 64 MiB raises RSS and release drops it by at least 90% of that") {
    const int64_t bytes = int64_t(64) << 20;
    const int64_t rss0 = fd::process_rss_bytes();
    REQUIRE(rss0 > 0);
    Arena a("rss");
    a.reserve(bytes);
    float * p = a.alloc_floats(bytes / 4);
    const int64_t page = sysconf(_SC_PAGESIZE);
    for (int64_t i = 0; i < bytes / 4; i += page / 4) { p[i] = 1.0f; }   // fault in every page
    const int64_t rss_touched = fd::process_rss_bytes();
    CHECK(rss_touched - rss0 >= bytes * 9 / 10);
    CHECK(a.release() == bytes);
    const int64_t rss_released = fd::process_rss_bytes();
    CAPTURE(rss0); CAPTURE(rss_touched); CAPTURE(rss_released);
    CHECK(rss_touched - rss_released >= bytes * 9 / 10);
}

}  // TEST_SUITE
