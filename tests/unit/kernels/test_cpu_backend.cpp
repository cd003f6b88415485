// The CPU backend (kernels/cpu/cpu_backend.cpp) dispatches to the CPU kernels: every op's result
// is bitwise the direct kernel call's (kernels/cpu, the oracle), run through backend memory
// (alloc / upload / download); the composite ops (embedding, row-wise silu_mul, row copies and
// gathers, per-row log-softmax / argmax) equal plain loops over the single-row kernels.
#include "fd/kernels/backend.h"
#include "fd/kernels/cpu_ops.h"
#include "fd/kernels/thread_pool.h"
#include "fd/status.h"

#include "test_util.h"

#include <doctest/doctest.h>

#include <cstring>
#include <limits>
#include <mutex>
#include <random>
#include <set>
#include <thread>
#include <vector>

namespace k = fd::kernels;

namespace {

using fd::test::bits_equal;
using fd::test::random_vec;


/// A host vector copied into backend memory (freed with the object).
struct Dev {
    k::Backend * be;
    void *       p;
    int64_t      bytes;
    template <typename T>
    Dev(k::Backend & b, const std::vector<T> & host) : be(&b), p(b.alloc(int64_t(host.size() * sizeof(T)))), bytes(int64_t(host.size() * sizeof(T))) {
        b.upload(p, host.data(), bytes);
    }
    Dev(k::Backend & b, int64_t n_floats) : be(&b), p(b.alloc(n_floats * 4)), bytes(n_floats * 4) {
        std::vector<float> nan(size_t(n_floats), std::numeric_limits<float>::quiet_NaN());  // unwritten output shows
        b.upload(p, nan.data(), bytes);
    }
    ~Dev() { be->free(p); }
    Dev(const Dev &) = delete;
    Dev & operator=(const Dev &) = delete;
    float * f() const { return static_cast<float *>(p); }
    std::vector<float> host() const {
        std::vector<float> h(size_t(bytes / 4));
        be->download(h.data(), p, bytes);
        return h;
    }
};

std::vector<uint16_t> to_bf16(const std::vector<float> & v) {
    std::vector<uint16_t> out(v.size());
    for (size_t i = 0; i < v.size(); ++i) {
        uint32_t u;
        std::memcpy(&u, &v[i], 4);
        out[i] = uint16_t(u >> 16);
    }
    return out;
}

}  // namespace

TEST_SUITE("kernels::cpu_backend") {

TEST_CASE("make_backend gives the cpu backend; bad thread counts are refused") {
    auto be = k::make_backend({.kind = k::DeviceKind::cpu, .n_threads = 3});
    CHECK(std::string(be->name()) == "cpu");
    CHECK(be->kind() == k::DeviceKind::cpu);
    CHECK(be->host_visible());
    CHECK(be->host_pool()->n_threads() == 3);
    CHECK(std::string(k::device_kind_name(k::DeviceKind::cuda)) == "cuda");
    try {
        k::make_cpu_backend(0);
        FAIL("0 threads accepted");
    } catch (const fd::Error & e) {
        CHECK(e.code() == fd::Errc::invalid_argument);
    }
}

TEST_CASE("memory: alloc is 64-byte aligned; upload, copy and download round-trip bytes") {
    auto be = k::make_cpu_backend(1);
    std::mt19937 rng(1);
    const auto src = random_vec(rng, 1000);
    Dev a(*be, src), b(*be, int64_t(1000));
    CHECK(reinterpret_cast<uintptr_t>(a.p) % 64 == 0);
    be->copy(b.p, a.p, a.bytes);
    be->synchronize();
    CHECK(bits_equal(b.host(), src));
    k::ScratchBuffer s(be.get());
    float * p1 = s.floats(10);
    CHECK(s.floats(5) == p1);  // no reallocation when shrinking
    CHECK(s.capacity_bytes() == 40);
    s.floats(1000);
    CHECK(s.capacity_bytes() == 4000);
}

TEST_CASE("on_each_thread runs once on every pool thread; release_scratch frees the kernels' scratch, the next call grows it again") {
    for (int threads : {1, 3}) {
        CAPTURE(threads);
        k::ThreadPool pool(threads);
        for (int round = 0; round < 50; ++round) {
            std::mutex                  mu;
            std::set<std::thread::id>   ids;
            int                         calls = 0;
            pool.on_each_thread([&] {
                std::lock_guard<std::mutex> lock(mu);
                ids.insert(std::this_thread::get_id());
                ++calls;
            });
            REQUIRE(calls == threads);
            REQUIRE(ids.size() == static_cast<size_t>(threads));
        }
    }
    // A 256-row linear packs x in the caller's thread_local scratch (and the workers' strips):
    // release_scratch hands that back, says how much, and the next call gives the same bits.
    std::mt19937 rng(3);
    auto be = k::make_cpu_backend(2);
    const int64_t n = 256, n_in = 512, n_out = 256;
    const auto x = random_vec(rng, n * n_in), w = random_vec(rng, n_out * n_in);
    Dev dx(*be, x), dw(*be, w), out(*be, n * n_out);
    be->linear(out.f(), dx.f(), dw.p, k::WType::f32, nullptr, n, n_out, n_in);
    const auto first = out.host();
    CHECK(be->release_scratch() >= n * n_in * static_cast<int64_t>(sizeof(float)));
    CHECK(be->release_scratch() == 0);  // nothing left to free
    be->linear(out.f(), dx.f(), dw.p, k::WType::f32, nullptr, n, n_out, n_in);
    CHECK(bits_equal(out.host(), first));
    CHECK(be->release_scratch() > 0);
}

TEST_CASE("linear, rms_norm, rope, add, kv_store and attention_paged equal the direct kernels bitwise") {
    std::mt19937 rng(7);
    for (int threads : {1, 3}) {
        CAPTURE(threads);
        auto be = k::make_cpu_backend(threads);
        k::ThreadPool pool(2);  // another thread count: the kernels promise the same bits
        const int64_t n = 11, n_in = 80, n_out = 37;
        const auto x = random_vec(rng, n * n_in), w = random_vec(rng, n_out * n_in), bias = random_vec(rng, n_out);
        for (k::WType wt : {k::WType::f32, k::WType::bf16}) {
            const auto wb = to_bf16(w);
            const void * wh = wt == k::WType::f32 ? static_cast<const void *>(w.data()) : wb.data();
            Dev dx(*be, x), dw = wt == k::WType::f32 ? Dev(*be, w) : Dev(*be, wb), db(*be, bias), out(*be, n * n_out);
            be->linear(out.f(), dx.f(), dw.p, wt, db.f(), n, n_out, n_in);
            std::vector<float> ref(size_t(n * n_out));
            k::linear(ref.data(), x.data(), wh, wt, bias.data(), n, n_out, n_in, &pool);
            CHECK(bits_equal(out.host(), ref));
        }
        // rms_norm (and in place)
        const auto nw = random_vec(rng, n_in, 0.5f, 1.5f);
        Dev dx(*be, x), dnw(*be, nw), dn(*be, n * n_in);
        be->rms_norm(dn.f(), dx.f(), dnw.f(), n, n_in, 1e-5f);
        std::vector<float> ref(x.size());
        k::rms_norm(ref.data(), x.data(), nw.data(), n, n_in, 1e-5f);
        CHECK(bits_equal(dn.host(), ref));
        be->rms_norm(dx.f(), dx.f(), dnw.f(), n, n_in, 1e-5f);
        CHECK(bits_equal(dx.host(), ref));
        // add
        const auto y = random_vec(rng, x.size());
        Dev da(*be, x), dy(*be, y);
        be->add(da.f(), dy.f(), int64_t(x.size()));
        std::vector<float> sum = x;
        k::add_inplace(sum.data(), y.data(), int64_t(x.size()));
        CHECK(bits_equal(da.host(), sum));
        // rope over a [n, heads, head_dim] tensor
        const int64_t heads = 3, hd = 16, n_pos = 64;
        std::vector<float> table(size_t(n_pos * hd));
        k::rope_table(table.data(), n_pos, hd, 10000.0f);
        std::vector<int32_t> pos(static_cast<size_t>(n));
        for (auto & p : pos) { p = int32_t(rng() % n_pos); }
        const auto qx = random_vec(rng, n * heads * hd);
        Dev dq(*be, qx), dt(*be, table);
        be->rope(dq.f(), pos.data(), dt.f(), n, heads, hd);
        std::vector<float> qref = qx;
        k::rope_rotate_half(qref.data(), pos.data(), table.data(), n, heads, hd);
        CHECK(bits_equal(dq.host(), qref));
        // kv_store then attention_paged: 2 sequences over scattered blocks, GQA 4 heads / 2 kv heads
        const int32_t bs = 4, kvh = 2, nh = 4, blocks = 12;
        const int64_t hdim = 32, row = kvh * hdim;
        std::vector<float> zeros(size_t(blocks * bs * row), 0.0f);
        Dev kp(*be, zeros), vp(*be, zeros);
        std::vector<float> kp_ref = zeros, vp_ref = zeros;
        const std::vector<std::vector<int32_t>> tables = {{7, 2, 10}, {0, 5}};
        const std::vector<int32_t> lens = {9, 6};
        std::vector<int64_t> slots;
        std::vector<k::AttnQuery> queries;
        for (size_t s = 0; s < tables.size(); ++s) {
            for (int32_t t = 0; t < lens[s]; ++t) {
                slots.push_back(int64_t(tables[s][t / bs]) * bs + t % bs);
                queries.push_back({tables[s].data(), t + 1});
            }
        }
        const int64_t nt = int64_t(slots.size());
        const auto kn = random_vec(rng, nt * row), vn = random_vec(rng, nt * row), q = random_vec(rng, nt * nh * hdim);
        Dev dk(*be, kn), dv(*be, vn), dqa(*be, q), dout(*be, nt * nh * hdim);
        const k::PagedKv kv{kp.f(), vp.f(), bs, kvh, int32_t(hdim)}, kv_ref{kp_ref.data(), vp_ref.data(), bs, kvh, int32_t(hdim)};
        be->begin_step({nullptr, nullptr, slots.data(), queries.data(), nt});
        be->kv_store(kv, dk.f(), dv.f(), slots.data(), nt);
        k::kv_store(kv_ref, kn.data(), vn.data(), slots.data(), nt);
        CHECK(bits_equal(kp.host(), kp_ref));
        CHECK(bits_equal(vp.host(), vp_ref));
        be->attention_paged(dout.f(), dqa.f(), queries.data(), nt, nh, kv, 0.17f);
        std::vector<float> att_ref(size_t(nt * nh * hdim));
        k::attention_paged(att_ref.data(), q.data(), queries.data(), nt, nh, kv_ref, 0.17f, nullptr);
        CHECK(bits_equal(dout.host(), att_ref));
    }
}

TEST_CASE("embedding gathers this rank's vocab rows (f32 and bf16 widened exactly), zeros elsewhere") {
    auto be = k::make_cpu_backend(2);
    std::mt19937 rng(3);
    const int64_t rows = 10, n_embd = 24, vocab_begin = 10;  // rank 1 of 3 over a 30-token vocab
    const auto table = random_vec(rng, rows * n_embd);
    const auto table_bf16 = to_bf16(table);
    const std::vector<int32_t> tokens = {10, 19, 3, 15, 25, 10};
    for (k::WType tt : {k::WType::f32, k::WType::bf16}) {
        Dev dt = tt == k::WType::f32 ? Dev(*be, table) : Dev(*be, table_bf16), out(*be, int64_t(tokens.size()) * n_embd);
        be->embedding(out.f(), dt.p, tt, tokens.data(), int64_t(tokens.size()), n_embd, vocab_begin, rows);
        const auto got = out.host();
        for (size_t t = 0; t < tokens.size(); ++t) {
            const int64_t id = tokens[t] - vocab_begin;
            for (int64_t j = 0; j < n_embd; ++j) {
                float want = 0.0f;
                if (id >= 0 && id < rows) {
                    if (tt == k::WType::f32) {
                        want = table[size_t(id * n_embd + j)];
                    } else {
                        const uint32_t u = uint32_t(table_bf16[size_t(id * n_embd + j)]) << 16;
                        std::memcpy(&want, &u, 4);
                    }
                }
                CHECK(std::memcmp(&got[t * n_embd + j], &want, 4) == 0);
            }
        }
    }
}

TEST_CASE("silu_mul over gate|up rows, copy_rows, gather_rows, log_softmax_rows and argmax_rows equal per-row kernels") {
    auto be = k::make_cpu_backend(1);
    std::mt19937 rng(5);
    const int64_t n = 5, ff = 19;
    const auto gu = random_vec(rng, n * 2 * ff, -4.0f, 4.0f);
    Dev dgu(*be, gu), dg(*be, n * ff);
    be->silu_mul(dg.f(), dgu.f(), n, ff);
    std::vector<float> ref(size_t(n * ff));
    for (int64_t t = 0; t < n; ++t) { k::silu_mul(&ref[t * ff], &gu[t * 2 * ff], &gu[t * 2 * ff + ff], ff); }
    CHECK(bits_equal(dg.host(), ref));

    // copy_rows: the v part of [n, q|k|v] rows into a contiguous [n, 7]
    const int64_t stride = 20;
    const auto src = random_vec(rng, n * stride);
    Dev ds(*be, src), dd(*be, n * 7);
    be->copy_rows(dd.f(), 7, ds.f() + 13, stride, n, 7);
    const auto got = dd.host();
    for (int64_t r = 0; r < n; ++r) {
        CHECK(std::memcmp(&got[r * 7], &src[r * stride + 13], 7 * 4) == 0);
    }
    // gather_rows, repeated and out of order
    const std::vector<int32_t> rows = {4, 0, 4, 2};
    Dev dgath(*be, int64_t(rows.size()) * stride);
    be->gather_rows(dgath.f(), ds.f(), rows.data(), int64_t(rows.size()), stride);
    const auto g = dgath.host();
    for (size_t i = 0; i < rows.size(); ++i) { CHECK(std::memcmp(&g[i * stride], &src[rows[i] * stride], stride * 4) == 0); }

    // log_softmax and argmax per row (a tie in row 1: the lowest index wins)
    const int64_t vocab = 50;
    auto logits = random_vec(rng, 3 * vocab, -5.0f, 5.0f);
    logits[vocab + 7] = logits[vocab + 30] = 9.0f;
    Dev dl(*be, logits), dls(*be, 3 * vocab);
    be->log_softmax_rows(dls.f(), dl.f(), 3, vocab);
    std::vector<float> lref(logits.size());
    for (int64_t r = 0; r < 3; ++r) { k::log_softmax(&lref[r * vocab], &logits[r * vocab], vocab); }
    CHECK(bits_equal(dls.host(), lref));
    std::vector<int64_t> am(3, -1);
    be->argmax_rows(am.data(), dl.f(), 3, vocab);
    for (int64_t r = 0; r < 3; ++r) { CHECK(am[r] == k::argmax(&logits[r * vocab], vocab)); }
    CHECK(am[1] == 7);
}

TEST_CASE("row-wise ops split over 2 and 3 threads (past the parallel threshold) equal the single-row kernels bitwise") {
    std::mt19937 rng(11);
    for (int threads : {1, 2, 3}) {
        CAPTURE(threads);
        auto be = k::make_cpu_backend(threads);
        for (int64_t n : {int64_t(2), int64_t(33), int64_t(257)}) {  // 257 x 96 floats: several ranges per thread
            CAPTURE(n);
            const int64_t w = 96;
            const auto x = random_vec(rng, n * w, -3.0f, 3.0f), nw = random_vec(rng, w, 0.5f, 1.5f);
            // rms_norm
            Dev dx(*be, x), dnw(*be, nw), dn(*be, n * w);
            be->rms_norm(dn.f(), dx.f(), dnw.f(), n, w, 1e-5f);
            std::vector<float> ref(x.size());
            k::rms_norm(ref.data(), x.data(), nw.data(), n, w, 1e-5f);
            CHECK(bits_equal(dn.host(), ref));
            // add
            const auto y = random_vec(rng, x.size());
            Dev da(*be, x), dy(*be, y);
            be->add(da.f(), dy.f(), n * w);
            std::vector<float> sum = x;
            k::add_inplace(sum.data(), y.data(), n * w);
            CHECK(bits_equal(da.host(), sum));
            // silu_mul over [n, gate | up]
            const auto gu = random_vec(rng, n * 2 * w, -4.0f, 4.0f);
            Dev dgu(*be, gu), dg(*be, n * w);
            be->silu_mul(dg.f(), dgu.f(), n, w);
            std::vector<float> sref(size_t(n * w));
            for (int64_t t = 0; t < n; ++t) { k::silu_mul(&sref[t * w], &gu[t * 2 * w], &gu[t * 2 * w + w], w); }
            CHECK(bits_equal(dg.host(), sref));
            // rope over [n, 3 heads, 32]
            const int64_t n_pos = 300, hd = 32;
            std::vector<float> table(size_t(n_pos * hd));
            k::rope_table(table.data(), n_pos, hd, 10000.0f);
            std::vector<int32_t> pos(static_cast<size_t>(n));
            for (auto & p : pos) { p = int32_t(rng() % n_pos); }
            const auto qx = random_vec(rng, n * 3 * hd);
            Dev dq(*be, qx), dt(*be, table);
            be->rope(dq.f(), pos.data(), dt.f(), n, 3, hd);
            std::vector<float> qref = qx;
            k::rope_rotate_half(qref.data(), pos.data(), table.data(), n, 3, hd);
            CHECK(bits_equal(dq.host(), qref));
            // copy_rows (the middle 40 of 96 columns) and gather_rows (reversed)
            Dev dc(*be, n * 40);
            be->copy_rows(dc.f(), 40, dx.f() + 30, w, n, 40);
            const auto c = dc.host();
            int bad = 0;
            for (int64_t r = 0; r < n; ++r) { bad += std::memcmp(&c[r * 40], &x[r * w + 30], 40 * 4) != 0; }
            CHECK(bad == 0);
            std::vector<int32_t> rows(static_cast<size_t>(n));
            for (int64_t i = 0; i < n; ++i) { rows[i] = int32_t(n - 1 - i); }
            Dev dgath(*be, n * w);
            be->gather_rows(dgath.f(), dx.f(), rows.data(), n, w);
            const auto g = dgath.host();
            bad = 0;
            for (int64_t i = 0; i < n; ++i) { bad += std::memcmp(&g[i * w], &x[rows[i] * w], w * 4) != 0; }
            CHECK(bad == 0);
            // embedding of n tokens from a 50-row table (f32)
            const auto emb = random_vec(rng, 50 * w);
            std::vector<int32_t> tok(static_cast<size_t>(n));
            for (auto & t : tok) { t = int32_t(rng() % 50); }
            Dev demb(*be, emb), de(*be, n * w);
            be->embedding(de.f(), demb.p, k::WType::f32, tok.data(), n, w, 0, 50);
            const auto e = de.host();
            bad = 0;
            for (int64_t i = 0; i < n; ++i) { bad += std::memcmp(&e[i * w], &emb[tok[i] * w], w * 4) != 0; }
            CHECK(bad == 0);
            // kv_store of a prefill starting mid-block over scattered blocks of 16 (2 kv heads x 32)
            const int32_t bs = 16, kvh = 2, blocks = 40;
            const int64_t row = kvh * hd;
            std::vector<int32_t> tbl;
            for (int32_t b = 0; b < blocks; ++b) { tbl.push_back((b * 7) % blocks); }
            std::vector<int64_t> slots(static_cast<size_t>(n));
            for (int64_t t = 0; t < n; ++t) { slots[t] = int64_t(tbl[(t + 5) / bs]) * bs + (t + 5) % bs; }
            const auto kn = random_vec(rng, n * row), vn = random_vec(rng, n * row);
            std::vector<float> zeros(size_t(blocks * bs * row), 0.0f);
            Dev kp(*be, zeros), vp(*be, zeros), dk(*be, kn), dv(*be, vn);
            std::vector<float> kp_ref = zeros, vp_ref = zeros;
            be->kv_store({kp.f(), vp.f(), bs, kvh, int32_t(hd)}, dk.f(), dv.f(), slots.data(), n);
            k::kv_store({kp_ref.data(), vp_ref.data(), bs, kvh, int32_t(hd)}, kn.data(), vn.data(), slots.data(), n);
            CHECK(bits_equal(kp.host(), kp_ref));
            CHECK(bits_equal(vp.host(), vp_ref));
        }
        // log_softmax_rows and argmax_rows over 20 rows of a 1000-token vocab
        const int64_t vocab = 1000, nr = 20;
        const auto logits = random_vec(rng, nr * vocab, -5.0f, 5.0f);
        Dev dl(*be, logits), dls(*be, nr * vocab);
        be->log_softmax_rows(dls.f(), dl.f(), nr, vocab);
        std::vector<float> lref(logits.size());
        for (int64_t r = 0; r < nr; ++r) { k::log_softmax(&lref[r * vocab], &logits[r * vocab], vocab); }
        CHECK(bits_equal(dls.host(), lref));
        std::vector<int64_t> am(static_cast<size_t>(nr), -1);
        be->argmax_rows(am.data(), dl.f(), nr, vocab);
        int bad = 0;
        for (int64_t r = 0; r < nr; ++r) { bad += am[r] != k::argmax(&logits[r * vocab], vocab); }
        CHECK(bad == 0);
    }
}

}  // TEST_SUITE
