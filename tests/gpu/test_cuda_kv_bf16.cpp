// The bf16 KV cache on CUDA (--kv-cache-dtype bfloat16; kernels/cuda/kv_store.cu,
// paged_attention.cu): kv_store writes the CPU kv_store's bf16 bits (round to nearest even), and
// attention over a bf16 pool is bitwise the CUDA attention over an f32 pool holding the widened
// values (the same kernel chains; only the loads widen), and agrees with the CPU bf16 attention
// to f32 rounding (the reduction orders differ, as in test_cuda_ops.cpp). Label gpu; skipped
// (exit 77) without a GPU.
#include "gpu_util.h"

#include "fd/kernels/cpu_ops.h"
#include "fd/kernels/cuda_ops.h"
#include "fd/kernels/ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

namespace K  = fd::kernels;
namespace KC = fd::kernels::cuda;
using fd::gputest::DevBuf;

namespace {

std::vector<float> randv(std::mt19937 & rng, size_t n) {
    std::uniform_real_distribution<float> d(-1.0f, 1.0f);
    std::vector<float> v(n);
    for (auto & x : v) { x = d(rng); }
    return v;
}

float widen(uint16_t h) {
    const uint32_t u = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}

}  // namespace

TEST_CASE("cuda bf16 KV: kv_store bits equal the CPU's; attention is bitwise the f32 kernel over the widened pool") {
    std::mt19937 rng(28);
    struct Shape { int32_t n_kv, group, hd, bs; };
    for (const Shape s : {Shape{2, 4, 64, 16}, Shape{4, 2, 128, 16}, Shape{2, 3, 48, 8}, Shape{1, 1, 16, 4}}) {
        CAPTURE(s.hd); CAPTURE(s.bs);
        const int32_t nh = s.n_kv * s.group, row = s.n_kv * s.hd;
        const std::vector<int> lens = {37, 300, 1, 90};
        int32_t n_blocks = 0, max_blocks = 0;
        for (const int n : lens) { n_blocks += (n + s.bs - 1) / s.bs; max_blocks = std::max(max_blocks, (n + s.bs - 1) / s.bs); }
        std::vector<int32_t> ids(static_cast<size_t>(n_blocks));
        std::iota(ids.begin(), ids.end(), 0);
        std::shuffle(ids.begin(), ids.end(), rng);
        const size_t elems = size_t(n_blocks) * s.bs * row;
        std::vector<uint16_t> k16(elems, 0), v16(elems, 0);
        DevBuf<uint16_t> dk16(k16), dv16(v16);
        const K::PagedKv host16{k16.data(), v16.data(), s.bs, s.n_kv, s.hd, K::WType::bf16};
        const K::PagedKv dev16{dk16.get(), dv16.get(), s.bs, s.n_kv, s.hd, K::WType::bf16};
        std::vector<int32_t> flat(size_t(lens.size()) * max_blocks, 0), table_row, n_ctx;
        std::vector<K::AttnQuery> queries;
        size_t next = 0;
        for (size_t q = 0; q < lens.size(); ++q) {
            const int n = lens[q];
            for (int b = 0; b < (n + s.bs - 1) / s.bs; ++b) { flat[q * max_blocks + b] = ids[next++]; }
            const auto kn = randv(rng, size_t(n) * row), vn = randv(rng, size_t(n) * row);
            std::vector<int64_t> slots(static_cast<size_t>(n));
            for (int t = 0; t < n; ++t) { slots[t] = int64_t(flat[q * max_blocks + t / s.bs]) * s.bs + t % s.bs; }
            K::kv_store(host16, kn.data(), vn.data(), slots.data(), n);
            DevBuf<float> dkn(kn), dvn(vn);
            DevBuf<int64_t> ds(slots);
            KC::kv_store(dev16, dkn.get(), dvn.get(), ds.get(), n, nullptr);
            for (int t = 0; t < n; ++t) {  // every position of the sequence queries (a prefill)
                table_row.push_back(int32_t(q));
                n_ctx.push_back(t + 1);
                queries.push_back({flat.data() + q * max_blocks, t + 1});
            }
        }
        CHECK(dk16.download() == k16);
        CHECK(dv16.download() == v16);
        std::vector<float> k32(elems), v32(elems);
        std::transform(k16.begin(), k16.end(), k32.begin(), widen);
        std::transform(v16.begin(), v16.end(), v32.begin(), widen);
        DevBuf<float> dk32(k32), dv32(v32);
        const int64_t n_tok = static_cast<int64_t>(queries.size());
        const auto    q = randv(rng, size_t(n_tok) * nh * s.hd);
        DevBuf<float>   dq(q), o16(q.size()), o32(q.size());
        DevBuf<int32_t> dflat(flat), drow(table_row), dctx(n_ctx);
        const KC::AttnBatch batch{dflat.get(), max_blocks, drow.get(), dctx.get()};
        const float scale = 1.0f / std::sqrt(float(s.hd));
        KC::attention_paged(o16.get(), dq.get(), batch, n_tok, nh, dev16, scale, nullptr);
        KC::attention_paged(o32.get(), dq.get(), batch, n_tok, nh, K::PagedKv{dk32.get(), dv32.get(), s.bs, s.n_kv, s.hd}, scale, nullptr);
        const auto g16 = o16.download(), g32 = o32.download();
        CHECK(std::memcmp(g16.data(), g32.data(), sizeof(float) * g16.size()) == 0);
        std::vector<float> cpu(q.size());
        K::attention_paged(cpu.data(), q.data(), queries.data(), n_tok, nh, host16, scale, nullptr);
        int64_t far = 0;
        for (size_t i = 0; i < cpu.size(); ++i) { far += !(std::fabs(g16[i] - cpu[i]) <= 1e-5f * std::max(1.0f, std::fabs(cpu[i]))); }
        CHECK(far == 0);
    }
}
