// The CUDA Backend (fd/kernels/cuda_backend.h) through the Backend interface with HOST index
// arrays, against the CPU ops: one step's embedding, rope, kv_store, attention (the step's
// queries staged once and reused by a second layer, and a query array outside the step),
// gather_rows, copy_rows, log_softmax_rows and argmax_rows. Label gpu; skipped (exit 77)
// without a GPU.
#include "gpu_util.h"

#include "fd/kernels/cuda_backend.h"
#include "fd/kernels/ops.h"
#if __has_include("fd/kernels/cpu_ops.h")
#include "fd/kernels/cpu_ops.h"  // linear, attention_paged with their ThreadPool (the Backend seam moves them)
#endif
#include "fd/memory/allocator.h"
#include "fd/status.h"

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

namespace K = fd::kernels;

namespace {

std::vector<float> randv(std::mt19937 & rng, size_t n) {
    std::uniform_real_distribution<float> d(-1.0f, 1.0f);
    std::vector<float>                    v(n);
    for (float & x : v) { x = d(rng); }
    return v;
}

/// Device copy of `h` through the backend.
float * put(K::Backend & b, const std::vector<float> & h) {
    auto * p = static_cast<float *>(b.alloc(static_cast<int64_t>(h.size() * sizeof(float))));
    b.upload(p, h.data(), static_cast<int64_t>(h.size() * sizeof(float)));
    return p;
}

std::vector<float> get(K::Backend & b, const float * p, size_t n) {
    std::vector<float> h(n);
    b.download(h.data(), p, static_cast<int64_t>(n * sizeof(float)));
    return h;
}

bool close(const std::vector<float> & g, const std::vector<float> & c, float atol) {
    REQUIRE(g.size() == c.size());
    size_t bad = 0;
    for (size_t i = 0; i < g.size(); ++i) { bad += !(std::fabs(g[i] - c[i]) <= atol * std::max(1.0f, std::fabs(c[i]))); }
    if (bad) { MESSAGE(bad, " of ", g.size(), " values differ"); }
    return bad == 0;
}

}  // namespace

TEST_CASE("CudaBackend runs a step's ops from host index arrays like the CPU ops") {
    auto be = K::make_cuda_backend(0, 2);
    CHECK(std::string(be->name()) == "cuda");
    CHECK(be->kind() == K::DeviceKind::cuda);
    CHECK_FALSE(be->host_visible());
    REQUIRE(be->host_pool() != nullptr);
    std::mt19937 rng(11);

    // Two sequences: a prefill of 5 tokens and a decode at position 20; block size 4.
    const int32_t bs = 4, n_kv = 2, group = 2, hd = 32, n_heads = n_kv * group, n_blocks = 12, vocab = 50, embd = 24;
    const std::vector<int32_t> table_a = {3, 7}, table_b = {0, 9, 2, 5, 11, 1};
    const std::vector<int32_t> tokens = {1, 2, 3, 4, 5, 60}, positions = {0, 1, 2, 3, 4, 20};
    std::vector<int64_t>       slots;
    std::vector<K::AttnQuery>  queries;
    for (int i = 0; i < 5; ++i) {
        slots.push_back(int64_t{table_a[i / bs]} * bs + i % bs);
        queries.push_back({table_a.data(), i + 1});
    }
    slots.push_back(int64_t{table_b[20 / bs]} * bs + 20 % bs);
    queries.push_back({table_b.data(), 21});
    const int64_t n = 6, row = int64_t{n_kv} * hd;

    // Embedding of rank 1 of 2 (vocab rows [50, 100)): token 60 has row 10, the others zeros.
    const auto table = randv(rng, static_cast<size_t>(vocab * embd));
    float *    d_table = put(*be, table);
    float *    d_x     = static_cast<float *>(be->alloc(n * embd * 4));
    be->begin_step(K::StepIndex{tokens.data(), positions.data(), slots.data(), queries.data(), n});
    be->embedding(d_x, d_table, K::WType::f32, tokens.data(), n, embd, 50, vocab);
    std::vector<float> emb_ref(static_cast<size_t>(n * embd), 0.0f);
    std::memcpy(&emb_ref[5 * embd], &table[10 * embd], sizeof(float) * embd);
    CHECK(get(*be, d_x, emb_ref.size()) == emb_ref);

    // rope + kv_store + attention, layer after layer with the same step arrays.
    std::vector<float> cos_sin(static_cast<size_t>(64 * hd));
    K::rope_table(cos_sin.data(), 64, hd, 10000.0f);
    auto       kpool = randv(rng, static_cast<size_t>(n_blocks * bs * row)), vpool = randv(rng, kpool.size());
    const auto q = randv(rng, static_cast<size_t>(n * n_heads * hd));
    const auto kn = randv(rng, static_cast<size_t>(n * row)), vn = randv(rng, kn.size());
    float *    d_cs = put(*be, cos_sin), *d_k = put(*be, kpool), *d_v = put(*be, vpool), *d_q = put(*be, q);
    float *    d_kn = put(*be, kn), *d_vn = put(*be, vn);
    float *    d_out = static_cast<float *>(be->alloc(static_cast<int64_t>(q.size() * 4)));
    auto       q_ref = q;
    K::rope_rotate_half(q_ref.data(), positions.data(), cos_sin.data(), n, n_heads, hd);
    K::kv_store(K::PagedKv{kpool.data(), vpool.data(), bs, n_kv, hd}, kn.data(), vn.data(), slots.data(), n);
    std::vector<float> attn_ref(q.size());
    K::attention_paged(attn_ref.data(), q_ref.data(), queries.data(), n, n_heads, K::PagedKv{kpool.data(), vpool.data(), bs, n_kv, hd},
                       1.0f / std::sqrt(float(hd)), nullptr);
    be->rope(d_q, positions.data(), d_cs, n, n_heads, hd);
    be->kv_store(K::PagedKv{d_k, d_v, bs, n_kv, hd}, d_kn, d_vn, slots.data(), n);
    for (int layer = 0; layer < 2; ++layer) {  // the second call reuses the staged attention batch
        be->attention_paged(d_out, d_q, queries.data(), n, n_heads, K::PagedKv{d_k, d_v, bs, n_kv, hd}, 1.0f / std::sqrt(float(hd)));
        CHECK(close(get(*be, d_out, q.size()), attn_ref, 1e-5f));
    }
    CHECK(close(get(*be, d_k, kpool.size()), kpool, 0.0f));
    // gather_rows: the last token of each sequence (rows 4 and 5), then row 0.
    const std::vector<int32_t> last = {4, 5, 0};
    float *                    d_last = static_cast<float *>(be->alloc(3 * n_heads * hd * 4));
    be->gather_rows(d_last, d_out, last.data(), 3, n_heads * hd);
    std::vector<float> last_ref;
    for (int32_t r : last) { last_ref.insert(last_ref.end(), attn_ref.begin() + r * n_heads * hd, attn_ref.begin() + (r + 1) * n_heads * hd); }
    CHECK(close(get(*be, d_last, last_ref.size()), last_ref, 1e-5f));
    // A query array that is not the step's (the decode alone) is staged on its own.
    const std::vector<K::AttnQuery> one = {queries[5]};
    be->attention_paged(d_out, d_q + 5 * n_heads * hd, one.data(), 1, n_heads, K::PagedKv{d_k, d_v, bs, n_kv, hd},
                        1.0f / std::sqrt(float(hd)));
    CHECK(close(get(*be, d_out, static_cast<size_t>(n_heads * hd)),
                std::vector<float>(attn_ref.begin() + 5 * n_heads * hd, attn_ref.end()), 1e-5f));

    // copy_rows (split q | k), log_softmax / argmax.
    float * d_part = static_cast<float *>(be->alloc(n * 8 * 4));
    be->copy_rows(d_part, 8, d_x, embd, n, 8);
    std::vector<float> part_ref;
    for (int64_t t = 0; t < n; ++t) { part_ref.insert(part_ref.end(), emb_ref.begin() + t * embd, emb_ref.begin() + t * embd + 8); }
    CHECK(get(*be, d_part, part_ref.size()) == part_ref);
    auto logits = randv(rng, 3 * 1000);
    logits[1000 + 17] = logits[1000 + 400] = 5.0f;  // a tie: 17 wins
    float *              d_logits = put(*be, logits);
    std::vector<int64_t> best(3);
    be->argmax_rows(best.data(), d_logits, 3, 1000);
    for (int r = 0; r < 3; ++r) { CHECK(best[r] == K::argmax(&logits[r * 1000], 1000)); }
    CHECK(best[1] == 17);
    std::vector<float> ls_ref(logits.size());
    for (int r = 0; r < 3; ++r) { K::log_softmax(&ls_ref[r * 1000], &logits[r * 1000], 1000); }
    be->log_softmax_rows(d_logits, d_logits, 3, 1000);
    CHECK(close(get(*be, d_logits, logits.size()), ls_ref, 1e-5f));
    be->synchronize();
    for (void * p : {static_cast<void *>(d_table), static_cast<void *>(d_x), static_cast<void *>(d_cs), static_cast<void *>(d_k),
                     static_cast<void *>(d_v), static_cast<void *>(d_q), static_cast<void *>(d_kn), static_cast<void *>(d_vn),
                     static_cast<void *>(d_out), static_cast<void *>(d_part), static_cast<void *>(d_last),
                     static_cast<void *>(d_logits)}) {
        be->free(p);
    }
}

TEST_CASE("the factories build the CUDA backend and allocator in a CUDA build") {
    auto be = K::make_backend(K::BackendConfig{K::DeviceKind::cuda, 2, 0});
    CHECK(std::string(be->name()) == "cuda");
    auto alloc = fd::memory::make_allocator(K::DeviceKind::cuda);
    CHECK(std::string(alloc->name()) == "cuda_vmm");
    CHECK(alloc->device() == K::DeviceKind::cuda);
    // Backend and allocator memory work together: a region written by upload, read back.
    std::byte *                 p = alloc->map(fd::memory::Tag::weight, 1000, true);
    const std::vector<float>    h = {1.5f, -2.0f, 3.25f};
    std::vector<float>          back(3);
    be->upload(p, h.data(), 12);
    be->download(back.data(), p, 12);
    CHECK(back == h);
}

TEST_CASE("make_cuda_backend refuses a device that is not there") {
    try {
        K::make_cuda_backend(4096, 1);
        FAIL("device 4096 must be refused");
    } catch (const fd::Error & e) {
        CHECK(e.code() == fd::Errc::invalid_argument);
    }
}
