// The ranks' collectives on CUDA (issue #9/#10, fd/comm/comm.h), exercised where a GPU is:
// - NcclComm of one rank on device 0: connect / disconnect / connect again create and destroy
//   NCCL communicators (nccl_comm_counts), a collective enqueued on the backend's stream runs
//   after the backend's earlier ops and before its later ones (no host wait in between);
// - two NCCL ranks on devices 0 and 1 (threads; only where 2 devices are visible): all-reduce
//   equals the host sum (a + b is one rounding either way), gather lands rank r in row r;
// - the staged comm (Gloo through pinned host buffers) for two CUDA ranks sharing device 0 —
//   the path --dist-backend auto takes for tp=2 on one GPU: sums bitwise Gloo's host sums.
#include "fd/kernels/backend.h"
#include "fd/kernels/cuda_backend.h"
#include "fd/comm/comm.h"
#include "fd/comm/tcp_store.h"

#include "gpu_util.h"

#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

using namespace fd;

namespace {

std::vector<float> input(int r, int64_t n) {
    std::mt19937 g(99 + r);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    std::uniform_int_distribution<int> e(-8, 8);
    std::vector<float> x(static_cast<size_t>(n));
    for (auto & v : x) { v = std::ldexp(u(g), e(g)); }
    return x;
}

/// Rank r's share of the two-rank checks, on `be` through `comm` (group generation 1):
/// all-reduce of input(r, n) (doubled on the stream first when `add_first`, so the collective
/// must see that earlier op's result) equals the host sum of both ranks' inputs, and a gather of
/// m floats lands rank r's values in row r on rank 0. Returns the mismatches it saw.
int two_rank_mismatches(kernels::Backend & be, comm::Comm & comm, int r, int64_t n, int64_t m, bool add_first) {
    comm.use_backend(&be);
    comm.connect(1);
    const auto x = input(r, n), x0 = input(0, n), x1 = input(1, n);
    const float f = add_first ? 2.0f : 1.0f;
    float * d = static_cast<float *>(be.alloc(n * 4));
    be.upload(d, x.data(), n * 4);
    if (add_first) { be.add(d, d, n); }
    comm.all_reduce_sum(d, n);
    std::vector<float> y(static_cast<size_t>(n));
    be.download(y.data(), d, n * 4);
    int b = 0;
    for (int64_t i = 0; i < n; ++i) { b += y[i] != f * x0[i] + f * x1[i]; }
    float * part = static_cast<float *>(be.alloc(m * 4));
    float * all  = static_cast<float *>(be.alloc(2 * m * 4));
    std::vector<float> p(static_cast<size_t>(m));
    for (int64_t i = 0; i < m; ++i) { p[i] = static_cast<float>(r * 10000 + i); }
    be.upload(part, p.data(), m * 4);
    comm.gather(part, m, r == 0 ? all : nullptr);
    if (r == 0) {
        std::vector<float> a(static_cast<size_t>(2 * m));
        be.download(a.data(), all, 2 * m * 4);
        for (int64_t i = 0; i < 2 * m; ++i) { b += a[i] != static_cast<float>((i / m) * 10000 + i % m); }
    } else {
        be.synchronize();  // the gather may still be queued on the stream: wait before freeing
    }
    comm.disconnect();
    be.free(d);
    be.free(part);
    be.free(all);
    return b;
}

}  // namespace

TEST_CASE("nccl, one rank: sleep-style disconnect destroys the communicator, connect builds a new one; stream order holds") {
    comm::TcpStoreServer store("127.0.0.1", 0);
    auto be = kernels::make_cuda_backend(0, 1);
    const auto before = comm::nccl_comm_counts();
    auto comm = comm::make_nccl_comm({.rank = 0, .world_size = 1, .store_port = store.port(), .timeout_s = 30}, 0);
    comm->use_backend(be.get());
    comm->connect(1);
    CHECK(comm->connected());
    CHECK(comm::nccl_comm_counts().live == before.live + 1);
    CHECK(comm::nccl_comm_counts().inits == before.inits + 1);
    const int64_t n = 1 << 20;
    const auto x = input(0, n);
    float * d = static_cast<float *>(be->alloc(n * 4));
    be->upload(d, x.data(), n * 4);
    be->add(d, d, n);            // 2x, on the stream
    comm->all_reduce_sum(d, n);  // one rank: the identity, enqueued after the add
    be->add(d, d, n);            // 4x, after the all-reduce
    std::vector<float> y(static_cast<size_t>(n));
    be->download(y.data(), d, n * 4);
    int64_t bad = 0;
    for (int64_t i = 0; i < n; ++i) { bad += y[i] != 4.0f * x[i]; }
    CHECK(bad == 0);
    comm->barrier();
    comm->disconnect();
    CHECK_FALSE(comm->connected());
    CHECK(comm::nccl_comm_counts().live == before.live);
    comm->connect(2);  // a rebuilt group: a fresh id under gen2/
    CHECK(comm::nccl_comm_counts().live == before.live + 1);
    CHECK(comm::nccl_comm_counts().inits == before.inits + 2);
    comm->all_reduce_sum(d, n);  // the rebuilt communicator works (still the identity)
    be->download(y.data(), d, n * 4);
    bad = 0;
    for (int64_t i = 0; i < n; ++i) { bad += y[i] != 4.0f * x[i]; }
    CHECK(bad == 0);
    comm->disconnect();
    be->free(d);
}

TEST_CASE("nccl, two ranks on two devices: all-reduce equals the host sum, gather in rank order") {
    int n_dev = 0;
    FD_CUDA_REQUIRE(cudaGetDeviceCount(&n_dev));
    if (n_dev < 2) {
        MESSAGE("one CUDA device visible: the two-device NCCL case needs two (NCCL refuses two ranks on one device)");
        return;
    }
    comm::TcpStoreServer store("127.0.0.1", 0);
    const int64_t n = 300000, m = 1000;
    int bad[2] = {1, 1};
    auto rank = [&](int r) {
        auto be   = kernels::make_cuda_backend(r, 1);
        auto comm = comm::make_nccl_comm({.rank = r, .world_size = 2, .store_port = store.port(), .timeout_s = 60}, r);
        bad[r]    = two_rank_mismatches(*be, *comm, r, n, m, false);
    };
    std::thread t1(rank, 1);
    rank(0);
    t1.join();
    CHECK(bad[0] == 0);
    CHECK(bad[1] == 0);
}

TEST_CASE("staged gloo, two CUDA ranks sharing device 0: sums bitwise the host Gloo sums, gather in rank order") {
    comm::TcpStoreServer store("127.0.0.1", 0);
    const int64_t n = 200000, m = 777;
    int bad[2] = {1, 1};
    auto rank = [&](int r) {
        auto be   = kernels::make_cuda_backend(0, 1);
        auto comm = comm::make_staged_comm(
            comm::make_gloo_comm({.rank = r, .world_size = 2, .store_port = store.port(), .timeout_s = 60}));
        bad[r] = two_rank_mismatches(*be, *comm, r, n, m, true);  // an op before the collective
    };
    std::thread t1(rank, 1);
    rank(0);
    t1.join();
    CHECK(bad[0] == 0);
    CHECK(bad[1] == 0);
}
