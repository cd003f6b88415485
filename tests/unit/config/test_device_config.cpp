// The device seams around the Backend (kernels/backend.cpp: device_available, device_count,
// host_mem_info, Backend::mem_info / alloc_pinned_host) and the device flags of resolve()
// (daemon/src/config.cpp: --device, --gpu-memory-utilization and its budget).
#include "fd/arena.h"
#include "fd/config.h"
#include "fd/kernels/backend.h"
#include "fd/status.h"
#include "test_util.h"

#include <doctest/doctest.h>
#include <fmt/format.h>

#include <sys/sysinfo.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace k = fd::kernels;

TEST_CASE("host_mem_info reads MemTotal and MemAvailable; the CPU backend reports it and has no pinned memory") {
    struct sysinfo si{};
    REQUIRE(sysinfo(&si) == 0);
    const double total = static_cast<double>(si.totalram) * si.mem_unit;  // the kernel's own count
    const k::MemInfo m = k::host_mem_info();
    CHECK(std::fabs(static_cast<double>(m.total_bytes) - total) <= 0.001 * total);
    CHECK(m.free_bytes > 0);
    CHECK(m.free_bytes <= m.total_bytes);
    auto be = k::make_cpu_backend(1);
    CHECK(be->mem_info().total_bytes == m.total_bytes);
    CHECK(be->alloc_pinned_host(4096) == nullptr);
    be->free_pinned_host(nullptr);
    CHECK(k::device_count(k::DeviceKind::cpu) == 1);
    std::string why;
    CHECK(k::device_available(k::DeviceKind::cpu, 0, &why));
    if (k::device_count(k::DeviceKind::cuda) == 0) {  // this machine: no GPU
        CHECK_FALSE(k::device_available(k::DeviceKind::cuda, 0, &why));
        CHECK(why.find("CUDA") != std::string::npos);
        CHECK(fd::test::error_of([] { k::device_mem_info(k::DeviceKind::cuda, 0); }) == fd::Errc::invalid_argument);
    }
}

TEST_CASE("gpu_kv_budget_bytes: utilization x total, less memory in use, weights and the rest; never negative") {
    const int64_t G = int64_t{1} << 30;
    const k::MemInfo m{60 * G, 80 * G};  // 20 GiB in use by others
    CHECK(fd::gpu_kv_budget_bytes(m, 0.9, 10 * G, 2 * G) == static_cast<int64_t>(0.9 * 80 * G) - 20 * G - 12 * G);
    CHECK(fd::gpu_kv_budget_bytes(m, 1.0, 0, 0) == 60 * G);
    CHECK(fd::gpu_kv_budget_bytes(m, 0.2, 1 * G, 0) == 0);  // 16 GiB allowed, 20 in use already
}

/// resolve() on stories260K's config after `edit`: the error code and message it fails with.
template <class Edit>
std::pair<fd::Errc, std::string> problems(Edit edit) {
    fd::Config c;
    c.model.model_dir = FD_SOURCE_DIR "/models/stories260K";
    edit(c);
    std::string what;
    const fd::Errc e = fd::test::error_of([&] { fd::resolve(c); }, &what);
    return std::make_pair(e, what);
}

TEST_CASE("resolve refuses CUDA-only flags on cpu and an unknown device, naming each") {
    auto [e2, w2] = problems([](fd::Config & c) { c.model.gpu_memory_utilization = 0.5; });
    CHECK(e2 == fd::Errc::invalid_argument);
    CHECK(w2.find("--gpu-memory-utilization needs --device cuda") != std::string::npos);
    auto [e3, w3] = problems([](fd::Config & c) { c.model.device = "tpu"; });
    CHECK(e3 == fd::Errc::invalid_argument);
    CHECK(w3.find("expected cpu or cuda") != std::string::npos);
    fd::Config ok;
    ok.model.model_dir       = FD_SOURCE_DIR "/models/stories260K";
    ok.model.batch_invariant = false;  // --no-batch-invariant: accepted on cpu
    CHECK(fd::resolve(ok).device == k::DeviceKind::cpu);
    if (k::device_count(k::DeviceKind::cuda) == 0) {
        auto [e4, w4] = problems([](fd::Config & c) { c.model.device = "cuda"; });
        CHECK(e4 == fd::Errc::invalid_argument);
        CHECK(w4.find("no CUDA device visible") != std::string::npos);
    }
}

TEST_CASE("resolve: --compute-dtype float32 | bfloat16 (and their short names); anything else is refused naming both") {
    for (auto [name, want] : {std::pair<const char *, k::ComputeType>{"float32", k::ComputeType::f32}, {"bfloat16", k::ComputeType::bf16},
                              {"bf16", k::ComputeType::bf16}, {"fp32", k::ComputeType::f32}}) {
        fd::Config c;
        c.model.model_dir     = FD_SOURCE_DIR "/models/stories260K";
        c.model.compute_dtype = name;
        CAPTURE(name);
        CHECK(fd::resolve(c).compute == want);
    }
    auto [e, w] = problems([](fd::Config & c) { c.model.compute_dtype = "float16"; });
    CHECK(e == fd::Errc::invalid_argument);
    CHECK(w.find("--compute-dtype 'float16' is not one of float32, bfloat16") != std::string::npos);
    auto [e2, w2] = problems([](fd::Config & c) { c.model.device = "cuda"; c.model.compute_dtype = "bfloat16"; });
    CHECK(e2 == fd::Errc::invalid_argument);
    CHECK(w2.find("--compute-dtype bfloat16 runs on the cpu backend only") != std::string::npos);
    auto be = k::make_cpu_backend(1, k::ComputeType::bf16);
    CHECK(be->compute_type() == k::ComputeType::bf16);
    CHECK(k::make_cpu_backend(1)->compute_type() == k::ComputeType::f32);
}

TEST_CASE("Backend::find_nonfinite (the download-and-scan default) finds the first NaN/Inf of F32, BF16 and F16, or -1") {
    auto be = k::make_cpu_backend(1);
    const int64_t n = 300000;  // several 256 KiB pieces
    std::vector<float> f(static_cast<size_t>(n), 0.5f);
    CHECK(be->find_nonfinite(f.data(), k::StoredType::f32, n) == -1);
    f[200001] = std::numeric_limits<float>::infinity();
    f[250000] = std::numeric_limits<float>::quiet_NaN();
    CHECK(be->find_nonfinite(f.data(), k::StoredType::f32, n) == 200001);
    std::vector<uint16_t> h(static_cast<size_t>(n), 0x3f00);  // 0.5 in BF16
    CHECK(be->find_nonfinite(h.data(), k::StoredType::bf16, n) == -1);
    h[131072] = 0x7fc0;  // BF16 NaN, first element of the second piece
    CHECK(be->find_nonfinite(h.data(), k::StoredType::bf16, n) == 131072);
    std::vector<uint16_t> g(static_cast<size_t>(n), 0x3800);  // 0.5 in F16
    g[n - 1] = 0xfc00;  // F16 -Inf, the last element
    CHECK(be->find_nonfinite(g.data(), k::StoredType::f16, n) == n - 1);
    CHECK(be->find_nonfinite(g.data(), k::StoredType::f16, n - 1) == -1);
}

TEST_CASE("resolve: --dist-backend nccl needs cuda, one node and a device per rank; auto picks shm/gloo on cpu") {
    auto [e1, w1] = problems([](fd::Config & c) {
        c.model.tensor_parallel_size = 2;
        c.parallel.dist_backend      = "nccl";
    });
    CHECK(e1 == fd::Errc::invalid_argument);
    CHECK(w1.find("--dist-backend nccl needs --device cuda") != std::string::npos);
    auto [e2, w2] = problems([](fd::Config & c) { c.parallel.dist_backend = "mpi"; });
    CHECK(e2 == fd::Errc::invalid_argument);
    CHECK(w2.find("expected gloo, shm, nccl or auto") != std::string::npos);
    if (k::device_count(k::DeviceKind::cuda) == 0) {
        // No GPU here: "no CUDA device visible" is one problem; the nccl rules are still named.
        auto [e3, w3] = problems([](fd::Config & c) {
            c.model.device               = "cuda";
            c.model.tensor_parallel_size = 2;
            c.parallel.dist_backend      = "nccl";
        });
        CHECK(e3 == fd::Errc::invalid_argument);
        CHECK(w3.find("no CUDA device visible") != std::string::npos);
        CHECK(w3.find("NCCL refuses two ranks of a group on one device") != std::string::npos);
        auto [e4, w4] = problems([](fd::Config & c) {
            c.model.device               = "cuda";
            c.model.tensor_parallel_size = 2;
            c.parallel.nnodes            = 2;
            c.parallel.master_port       = 29999;
            c.parallel.dist_backend      = "nccl";
        });
        CHECK(w4.find("NCCL across hosts is not supported yet") != std::string::npos);
        // tp > 1 on cuda is no longer refused for itself: only the missing device is.
        auto [e5, w5] = problems([](fd::Config & c) {
            c.model.device               = "cuda";
            c.model.tensor_parallel_size = 2;
        });
        CHECK(e5 == fd::Errc::invalid_argument);
        CHECK(w5.find("no CUDA device visible") != std::string::npos);
        CHECK(w5.find("tensor-parallel") == std::string::npos);
    }
    fd::Config one;
    one.model.model_dir            = FD_SOURCE_DIR "/models/stories260K";
    one.model.tensor_parallel_size = 2;
    const auto r1 = fd::resolve(one);
    CHECK(r1.dist_backend == fd::runtime::DistBackend::shm);
    CHECK(r1.n_devices == 1);
    CHECK(r1.ranks_per_device == 1);
    fd::Config two = one;
    two.parallel.nnodes      = 2;
    two.parallel.master_port = 29998;
    CHECK(fd::resolve(two).dist_backend == fd::runtime::DistBackend::gloo);
    fd::Config g = one;
    g.parallel.dist_backend = "gloo";
    CHECK(fd::resolve(g).dist_backend == fd::runtime::DistBackend::gloo);
}

TEST_CASE("resolve: --kv-cache-bytes is bytes with a unit or a bare fraction, and must fit the memory available; --threads is bounded") {
    const int64_t avail = fd::mem_available_bytes();
    REQUIRE(avail > 0);
    const auto kv = [](std::string v) { return [v](fd::Config & c) { c.kv.kv_cache_bytes = v; }; };
    // "0.5MiB" was a fraction of memory (a pool of GiBs), "1.5GiB" "fraction must be in (0, 1]",
    // "abc.def" and "." an internal error (std::stod) (probes)
    fd::Config half;
    half.model.model_dir      = FD_SOURCE_DIR "/models/stories260K";
    half.kv.kv_cache_bytes    = "1.5MiB";
    CHECK(fd::resolve(half).kv_budget_bytes == 3LL << 19);
    for (const char * bad : {"abc.def", ".", "1.5", "2.0", "lots"}) {
        auto [e, w] = problems(kv(bad));
        CAPTURE(bad);
        CAPTURE(w);
        CHECK(e == fd::Errc::invalid_argument);
        CHECK(w.find(std::string("--kv-cache-bytes '") + bad + "'") != std::string::npos);
    }
    // More than the memory available: refused naming the flag (it pre-faulted until the OOM
    // killer came, or 1000T failed an internal check in the arena's mmap)
    for (const char * big : {"1000T", "8589934591G"}) {
        auto [e, w] = problems(kv(big));
        CAPTURE(w);
        CHECK(e == fd::Errc::invalid_argument);
        CHECK(w.find(std::string("--kv-cache-bytes ") + big) != std::string::npos);
        CHECK(w.find("exceeds the memory available now") != std::string::npos);
    }
    // the KV pool and --swap-space together: each fits, both do not
    const double three_quarters_gib = 0.75 * static_cast<double>(avail) / static_cast<double>(int64_t{1} << 30);
    auto [es, ws] = problems([&](fd::Config & c) {
        c.kv.kv_cache_bytes = "0.5";
        c.kv.swap_space_gib = three_quarters_gib;
    });
    CAPTURE(ws);
    CHECK(es == fd::Errc::invalid_argument);
    CHECK(ws.find("--kv-cache-bytes 0.5 (a KV pool of") != std::string::npos);
    CHECK(ws.find("plus --swap-space") != std::string::npos);
    // --threads 100000 spawned ~7000 threads and aborted; -1 was silently 0 (probes)
    for (int32_t n : {-1, 1025, 100000}) {
        auto [e, w] = problems([n](fd::Config & c) { c.model.n_threads = n; });
        CAPTURE(n);
        CHECK(e == fd::Errc::invalid_argument);
        CHECK(w.find(fmt::format("--threads {} must be in [0, 1024]", n)) != std::string::npos);
    }
    fd::Config max;
    max.model.model_dir = FD_SOURCE_DIR "/models/stories260K";
    max.model.n_threads = 1024;
    CHECK(fd::resolve(max).model.n_kv_heads > 0);
}
