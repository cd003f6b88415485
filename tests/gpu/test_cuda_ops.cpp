// The CUDA ops (fd/kernels/cuda_ops.h) against their CPU twins (fd/kernels/ops.h, the oracle) on
// random shapes, and the batch invariance of linear and attention: row r's output bitwise equal
// for n_rows 1..64. Label gpu; skipped (exit 77) without a GPU.
//
// Tolerances: the reduction orders differ from the CPU's 16-lane chains, so results agree to f32
// rounding, not bitwise: |gpu - cpu| <= 1e-5 * max(|cpu|, scale) with `scale` the size the
// rounding errors are relative to (sum |x_k w_k| for a dot product, max |V| for attention).
// bf16 weights are widened exactly on both sides, so they get the f32 tolerance too.
#include "gpu_util.h"

#include "fd/kernels/cuda_ops.h"
#include "fd/kernels/ops.h"
#if __has_include("fd/kernels/cpu_ops.h")
#include "fd/kernels/cpu_ops.h"  // linear, attention_paged with their ThreadPool (the Backend seam moves them)
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <utility>
#include <vector>

namespace K  = fd::kernels;
namespace KC = fd::kernels::cuda;
using fd::gputest::DevBuf;

namespace {

constexpr float kTol = 1e-5f;

std::vector<float> randv(std::mt19937 & rng, size_t n, float lo = -1.0f, float hi = 1.0f) {
    std::uniform_real_distribution<float> d(lo, hi);
    std::vector<float>                    v(n);
    for (float & x : v) { x = d(rng); }
    return v;
}

std::vector<uint16_t> to_bf16(const std::vector<float> & v) {
    std::vector<uint16_t> b(v.size());
    for (size_t i = 0; i < v.size(); ++i) {
        uint32_t bits;
        std::memcpy(&bits, &v[i], 4);
        b[i] = static_cast<uint16_t>(bits >> 16);
    }
    return b;
}

int64_t rand_int(std::mt19937 & rng, int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); }

/// Counts elements with |g - c| > tol * max(|c|, scale[i]) and reports the first few.
int64_t count_far(const std::vector<float> & g, const std::vector<float> & c, const std::vector<float> & scale, float tol,
                  const char * what) {
    REQUIRE(g.size() == c.size());
    int64_t bad = 0;
    for (size_t i = 0; i < g.size(); ++i) {
        const float lim = tol * std::max(std::fabs(c[i]), scale[i % scale.size()]);
        if (!(std::fabs(g[i] - c[i]) <= lim)) {
            if (bad++ < 5) { MESSAGE(what, " [", i, "]: gpu ", g[i], " cpu ", c[i], " limit ", lim); }
        }
    }
    return bad;
}

bool bitwise_equal(const float * a, const float * b, size_t n) { return std::memcmp(a, b, sizeof(float) * n) == 0; }

}  // namespace

TEST_CASE("cuda embedding equals the CPU gather (f32 and bf16, a rank's vocab rows; other ids give zeros)") {
    std::mt19937 rng(1);
    for (int iter = 0; iter < 6; ++iter) {
        const int64_t vocab = rand_int(rng, 5, 300), n_embd = rand_int(rng, 1, 700), n = rand_int(rng, 1, 40);
        const int64_t begin = iter % 2 ? rand_int(rng, 1, 100) : 0;  // tensor-parallel rank > 0: rows [begin, begin + vocab)
        const auto    table = randv(rng, static_cast<size_t>(vocab * n_embd));
        const auto    tb    = to_bf16(table);
        std::vector<int32_t> ids(static_cast<size_t>(n));
        for (auto & id : ids) { id = static_cast<int32_t>(rand_int(rng, 0, begin + vocab + 1)); }
        for (const bool bf16 : {false, true}) {
            std::vector<float> ref(static_cast<size_t>(n * n_embd), 0.0f);
            for (int64_t t = 0; t < n; ++t) {
                const int64_t row = ids[t] - begin;
                if (row < 0 || row >= vocab) { continue; }
                if (bf16) {
                    K::bf16_to_f32(&ref[t * n_embd], &tb[row * n_embd], n_embd);
                } else {
                    std::memcpy(&ref[t * n_embd], &table[row * n_embd], sizeof(float) * n_embd);
                }
            }
            DevBuf<float>    d_table(table);
            DevBuf<uint16_t> d_tb(tb);
            DevBuf<int32_t>  d_ids(ids);
            DevBuf<float>    d_out(ref.size());
            KC::embedding(d_out.get(), d_ids.get(), bf16 ? static_cast<const void *>(d_tb.get()) : d_table.get(),
                          bf16 ? K::WType::bf16 : K::WType::f32, n, n_embd, begin, vocab, nullptr);
            const auto got = d_out.download();
            CHECK(bitwise_equal(got.data(), ref.data(), ref.size()));
        }
    }
}

TEST_CASE("cuda rms_norm, silu_mul, add_inplace equal the CPU ops within f32 rounding") {
    std::mt19937 rng(2);
    for (const int64_t n_embd : {1, 64, 255, 2048, 5000}) {
        const int64_t n_rows = rand_int(rng, 1, 9);
        const auto    x = randv(rng, static_cast<size_t>(n_rows * n_embd), -3.0f, 3.0f);
        const auto    w = randv(rng, static_cast<size_t>(n_embd), 0.5f, 1.5f);
        std::vector<float> ref(x.size());
        K::rms_norm(ref.data(), x.data(), w.data(), n_rows, n_embd, 1e-5f);
        DevBuf<float> d_x(x), d_w(w), d_out(x.size());
        KC::rms_norm(d_out.get(), d_x.get(), d_w.get(), n_rows, n_embd, 1e-5f, nullptr);
        CHECK(count_far(d_out.download(), ref, {1e-6f}, kTol, "rms_norm") == 0);
        KC::rms_norm(d_x.get(), d_x.get(), d_w.get(), n_rows, n_embd, 1e-5f, nullptr);  // in place
        CHECK(count_far(d_x.download(), ref, {1e-6f}, kTol, "rms_norm in place") == 0);
    }
    for (const int64_t n : {1, 1000, 300001}) {
        const auto gate = randv(rng, static_cast<size_t>(n), -20.0f, 20.0f), up = randv(rng, static_cast<size_t>(n));
        std::vector<float> ref(gate.size()), sum(gate.size());
        K::silu_mul(ref.data(), gate.data(), up.data(), n);
        sum = gate;
        K::add_inplace(sum.data(), up.data(), n);
        DevBuf<float> d_g(gate), d_u(up), d_out(gate.size());
        KC::silu_mul(d_out.get(), d_g.get(), d_u.get(), n, nullptr);
        CHECK(count_far(d_out.download(), ref, {1e-30f}, kTol, "silu_mul") == 0);
        KC::add_inplace(d_g.get(), d_u.get(), n, nullptr);
        const auto got = d_g.download();
        CHECK(bitwise_equal(got.data(), sum.data(), sum.size()));  // one rounding, same on both
    }
}

TEST_CASE("cuda silu_mul_rows and gather_rows equal the CPU ops on the same rows") {
    std::mt19937  rng(10);
    const int64_t n_rows = 7, n_ff = 333;
    const auto    gu = randv(rng, static_cast<size_t>(n_rows * 2 * n_ff), -8.0f, 8.0f);
    std::vector<float> ref(static_cast<size_t>(n_rows * n_ff));
    for (int64_t t = 0; t < n_rows; ++t) { K::silu_mul(&ref[t * n_ff], &gu[t * 2 * n_ff], &gu[t * 2 * n_ff + n_ff], n_ff); }
    DevBuf<float> d_gu(gu), d_out(ref.size());
    KC::silu_mul_rows(d_out.get(), d_gu.get(), n_rows, n_ff, nullptr);
    const auto got = d_out.download();
    CHECK(count_far(got, ref, {1e-30f}, kTol, "silu_mul_rows") == 0);
    const std::vector<int32_t> rows = {6, 0, 3, 3};
    std::vector<float>         gref;
    for (int32_t r : rows) { gref.insert(gref.end(), got.begin() + r * n_ff, got.begin() + (r + 1) * n_ff); }
    DevBuf<int32_t> d_rows(rows);
    DevBuf<float>   d_g(gref.size());
    KC::gather_rows(d_g.get(), d_out.get(), d_rows.get(), 4, n_ff, nullptr);
    CHECK(d_g.download() == gref);
}

TEST_CASE("cuda rope_rotate_half equals the CPU op (Llama theta 1e4, Qwen theta 1e6)") {
    std::mt19937 rng(3);
    for (const float theta : {10000.0f, 1000000.0f}) {
        for (const int64_t head_dim : {2, 64, 128}) {
            const int64_t n_pos = 4096, n_tokens = rand_int(rng, 1, 33), n_heads = rand_int(rng, 1, 12);
            std::vector<float> table(static_cast<size_t>(n_pos * head_dim));
            K::rope_table(table.data(), n_pos, head_dim, theta);
            std::vector<int32_t> pos(static_cast<size_t>(n_tokens));
            for (auto & p : pos) { p = static_cast<int32_t>(rand_int(rng, 0, n_pos - 1)); }
            const auto x = randv(rng, static_cast<size_t>(n_tokens * n_heads * head_dim));
            auto       ref = x;
            K::rope_rotate_half(ref.data(), pos.data(), table.data(), n_tokens, n_heads, head_dim);
            DevBuf<float>   d_x(x), d_table(table);
            DevBuf<int32_t> d_pos(pos);
            KC::rope_rotate_half(d_x.get(), d_pos.get(), d_table.get(), n_tokens, n_heads, head_dim, nullptr);
            CHECK(count_far(d_x.download(), ref, {1.0f}, kTol, "rope") == 0);
        }
    }
}

TEST_CASE("cuda log_softmax_argmax equals the CPU log_softmax and argmax (lowest index on ties)") {
    std::mt19937 rng(4);
    for (const int64_t n : {1, 7, 256, 257, 32000, 151936}) {
        const int64_t n_rows = rand_int(rng, 1, 6);
        auto          x = randv(rng, static_cast<size_t>(n_rows * n), -10.0f, 10.0f);
        for (int64_t r = 0; r < n_rows && n > 2; ++r) {  // a tie for the maximum: the lower index wins
            const int64_t a = rand_int(rng, 0, n - 2), b = rand_int(rng, a + 1, n - 1);
            x[r * n + a] = x[r * n + b] = 11.0f;
        }
        std::vector<float>   ref(x.size());
        std::vector<int64_t> best_ref(static_cast<size_t>(n_rows));
        for (int64_t r = 0; r < n_rows; ++r) {
            K::log_softmax(&ref[r * n], &x[r * n], n);
            best_ref[r] = K::argmax(&x[r * n], n);
        }
        DevBuf<float>   d_x(x), d_out(x.size());
        DevBuf<int64_t> d_best(best_ref.size());
        KC::log_softmax_argmax(d_out.get(), d_best.get(), d_x.get(), n_rows, n, nullptr);
        CHECK(count_far(d_out.download(), ref, {1.0f}, kTol, "log_softmax") == 0);
        CHECK(d_best.download() == best_ref);
        KC::log_softmax_argmax(d_x.get(), nullptr, d_x.get(), n_rows, n, nullptr);  // in place, no argmax
        CHECK(count_far(d_x.download(), ref, {1.0f}, kTol, "log_softmax in place") == 0);
    }
}

namespace {

/// y = x · Wᵀ + bias on both backends; returns the GPU result, `ref` the CPU one and `scale`
/// sum_k |x[r, k] W[o, k]| per output.
std::vector<float> run_linear(std::mt19937 & rng, int64_t n_rows, int64_t n_out, int64_t n_in, K::WType wt, bool with_bias,
                              std::vector<float> & ref, std::vector<float> & scale) {
    const auto x = randv(rng, static_cast<size_t>(n_rows * n_in));
    auto       w = randv(rng, static_cast<size_t>(n_out * n_in));
    const auto wb = to_bf16(w);
    if (wt == K::WType::bf16) { K::bf16_to_f32(w.data(), wb.data(), static_cast<int64_t>(w.size())); }
    const auto bias = randv(rng, static_cast<size_t>(n_out));
    ref.assign(static_cast<size_t>(n_rows * n_out), 0.0f);
    const void * wh = wt == K::WType::bf16 ? static_cast<const void *>(wb.data()) : w.data();
    K::linear(ref.data(), x.data(), wh, wt, with_bias ? bias.data() : nullptr, n_rows, n_out, n_in, nullptr);
    scale.assign(ref.size(), 0.0f);
    for (int64_t r = 0; r < n_rows; ++r) {
        for (int64_t o = 0; o < n_out; ++o) {
            double s = with_bias ? std::fabs(bias[o]) : 0.0;
            for (int64_t k = 0; k < n_in; ++k) { s += std::fabs(static_cast<double>(x[r * n_in + k]) * w[o * n_in + k]); }
            scale[r * n_out + o] = static_cast<float>(s);
        }
    }
    DevBuf<float>    d_x(x), d_w(w), d_bias(bias), d_out(ref.size());
    DevBuf<uint16_t> d_wb(wb);
    KC::linear(d_out.get(), d_x.get(), wt == K::WType::bf16 ? static_cast<const void *>(d_wb.get()) : d_w.get(), wt,
               with_bias ? d_bias.get() : nullptr, n_rows, n_out, n_in, nullptr);
    return d_out.download();
}

}  // namespace

TEST_CASE("cuda linear equals the CPU linear on random shapes (f32 and bf16 weights, with and without bias)") {
    std::mt19937 rng(5);
    for (int iter = 0; iter < 24; ++iter) {
        const int64_t n_rows = std::vector<int64_t>{1, 3, 64, 65, 130}[rand_int(rng, 0, 4)];
        const int64_t n_out  = std::vector<int64_t>{1, 63, 64, 200, 513}[rand_int(rng, 0, 4)];
        // 160: the skinny kernel's last W tile (128 bf16 k) holds 32 k and its padding.
        const int64_t n_in   = std::vector<int64_t>{1, 31, 32, 160, 257, 1024, 2048}[rand_int(rng, 0, 6)];
        const auto    wt     = iter % 2 ? K::WType::bf16 : K::WType::f32;
        const bool    bias   = iter % 3 == 0;
        CAPTURE(n_rows); CAPTURE(n_out); CAPTURE(n_in); CAPTURE(iter);
        std::vector<float> ref, scale;
        const auto         got = run_linear(rng, n_rows, n_out, n_in, wt, bias, ref, scale);
        CHECK(count_far(got, ref, scale, kTol, "linear") == 0);
    }
}

// n_rows 1..96 crosses the skinny kernel (n_rows <= 64) and the tiled one: both must give a row
// the same bits.
TEST_CASE("cuda linear is batch-invariant: row r bitwise equal for n_rows 1..96 (skinny and tiled kernels)") {
    std::mt19937 rng(6);
    // n_in 1000 and 160: the skinny kernel's last W tile full to 104 and to 32 k of 128 (bf16).
    for (const auto & [wt, n_in] : {std::pair{K::WType::f32, int64_t{1000}}, std::pair{K::WType::bf16, int64_t{1000}},
                                  std::pair{K::WType::bf16, int64_t{160}}}) {
        CAPTURE(n_in);
        const int64_t n_out = 300, n_max = 96;
        const auto    x  = randv(rng, static_cast<size_t>(n_max * n_in));
        const auto    w  = randv(rng, static_cast<size_t>(n_out * n_in));
        const auto    wb = to_bf16(w);
        const auto    bias = randv(rng, static_cast<size_t>(n_out));
        DevBuf<float>    d_x(x), d_w(w), d_bias(bias), d_full(static_cast<size_t>(n_max * n_out)), d_part(d_full.size());
        DevBuf<uint16_t> d_wb(wb);
        const void *     wd = wt == K::WType::bf16 ? static_cast<const void *>(d_wb.get()) : d_w.get();
        KC::linear(d_full.get(), d_x.get(), wd, wt, d_bias.get(), n_max, n_out, n_in, nullptr);
        const auto full = d_full.download();
        int64_t    mismatched = 0;
        for (int64_t n = 1; n <= n_max; ++n) {
            KC::linear(d_part.get(), d_x.get(), wd, wt, d_bias.get(), n, n_out, n_in, nullptr);
            const auto part = d_part.download();
            mismatched += bitwise_equal(part.data(), full.data(), static_cast<size_t>(n * n_out)) ? 0 : 1;
        }
        CHECK(mismatched == 0);
        // The same row next to different rows (row 5 moved to row 0 of a batch of 1).
        DevBuf<float> d_x5(std::vector<float>(x.begin() + 5 * n_in, x.begin() + 6 * n_in)), d_one(static_cast<size_t>(n_out));
        KC::linear(d_one.get(), d_x5.get(), wd, wt, d_bias.get(), 1, n_out, n_in, nullptr);
        const auto one = d_one.download();
        CHECK(bitwise_equal(one.data(), full.data() + 5 * n_out, static_cast<size_t>(n_out)));
    }
}

namespace {

/// A paged-attention problem: sequences with random lengths whose last `n_q` positions are
/// queries (a prefill when n_q > 1, a decode when 1), blocks scattered over the pool.
struct AttnCase {
    int64_t n_kv, group, hd, bs, n_blocks = 0, n_tokens = 0, max_blocks = 0;
    std::vector<std::vector<int32_t>> tables;  // per sequence
    std::vector<int32_t>              table_row, n_ctx;
    std::vector<float>                k, v, q;

    AttnCase(std::mt19937 & rng, int64_t n_kv_, int64_t group_, int64_t hd_, int64_t bs_, const std::vector<std::pair<int, int>> & seqs)
        : n_kv(n_kv_), group(group_), hd(hd_), bs(bs_) {
        for (const auto & [len, n_q] : seqs) { n_blocks += (len + bs - 1) / bs; }
        n_blocks += 3;
        std::vector<int32_t> ids(static_cast<size_t>(n_blocks));
        std::iota(ids.begin(), ids.end(), 0);
        std::shuffle(ids.begin(), ids.end(), rng);
        size_t next = 0;
        for (size_t s = 0; s < seqs.size(); ++s) {
            const auto [len, n_q] = seqs[s];
            std::vector<int32_t> t(static_cast<size_t>((len + bs - 1) / bs));
            for (auto & b : t) { b = ids[next++]; }
            max_blocks = std::max<int64_t>(max_blocks, static_cast<int64_t>(t.size()));
            tables.push_back(t);
            for (int j = 0; j < n_q; ++j) {
                table_row.push_back(static_cast<int32_t>(s));
                n_ctx.push_back(len - n_q + j + 1);
            }
        }
        n_tokens = static_cast<int64_t>(n_ctx.size());
        k = randv(rng, static_cast<size_t>(n_blocks * bs * n_kv * hd));
        v = randv(rng, k.size());
        q = randv(rng, static_cast<size_t>(n_tokens * n_kv * group * hd));
    }
    std::vector<int32_t> flat_tables() const {
        std::vector<int32_t> f(tables.size() * static_cast<size_t>(max_blocks), 0);
        for (size_t s = 0; s < tables.size(); ++s) { std::copy(tables[s].begin(), tables[s].end(), f.begin() + s * max_blocks); }
        return f;
    }
    std::vector<float> cpu() const {
        std::vector<K::AttnQuery> qs;
        for (int64_t i = 0; i < n_tokens; ++i) { qs.push_back({tables[table_row[i]].data(), n_ctx[i]}); }
        std::vector<float> out(q.size());
        K::PagedKv kv{const_cast<float *>(k.data()), const_cast<float *>(v.data()), static_cast<int32_t>(bs),
                      static_cast<int32_t>(n_kv), static_cast<int32_t>(hd)};
        K::attention_paged(out.data(), q.data(), qs.data(), n_tokens, n_kv * group, kv, 1.0f / std::sqrt(float(hd)), nullptr);
        return out;
    }
};

/// The case on the GPU for its first `n` query tokens (device buffers held by the caller's case copy).
struct AttnDev {
    DevBuf<float>   k, v, q, out;
    DevBuf<int32_t> tables, row, ctx;
    explicit AttnDev(const AttnCase & c)
        : k(c.k), v(c.v), q(c.q), out(c.q.size()), tables(c.flat_tables()), row(c.table_row), ctx(c.n_ctx) {}
    std::vector<float> run(const AttnCase & c, int64_t n) {
        KC::AttnBatch b{tables.get(), static_cast<int32_t>(c.max_blocks), row.get(), ctx.get()};
        K::PagedKv    kv{k.get(), v.get(), static_cast<int32_t>(c.bs), static_cast<int32_t>(c.n_kv), static_cast<int32_t>(c.hd)};
        FD_CUDA_REQUIRE(cudaMemset(out.get(), 0xff, sizeof(float) * out.size()));  // NaN: unwritten rows show
        KC::attention_paged(out.get(), q.get(), b, n, c.n_kv * c.group, kv, 1.0f / std::sqrt(float(c.hd)), nullptr);
        return out.download();
    }
};

}  // namespace

TEST_CASE("cuda attention_paged equals the CPU attention (prefill and decode, GQA, odd head_dim, block sizes)") {
    std::mt19937 rng(7);
    struct Shape { int64_t n_kv, group, hd, bs; };
    for (const Shape s : {Shape{1, 1, 16, 4}, Shape{2, 4, 64, 16}, Shape{4, 2, 128, 16}, Shape{2, 3, 48, 8},
                          Shape{1, 8, 256, 32}, Shape{8, 1, 512, 16}, Shape{2, 2, 8, 1}}) {
        CAPTURE(s.n_kv); CAPTURE(s.group); CAPTURE(s.hd); CAPTURE(s.bs);
        // A prefill of 37 tokens, a long decode, a chunked prefill continuing at 300, short decodes.
        const AttnCase c(rng, s.n_kv, s.group, s.hd, s.bs, {{37, 37}, {1000, 1}, {340, 40}, {1, 1}, {17, 1}});
        AttnDev        d(c);
        const auto     got = d.run(c, c.n_tokens);
        CHECK(count_far(got, c.cpu(), {1.0f}, kTol, "attention") == 0);  // outputs average V in [-1, 1]
    }
}

TEST_CASE("cuda attention_paged is batch-invariant: row r bitwise equal for n_rows 1..64") {
    std::mt19937                     rng(8);
    std::vector<std::pair<int, int>> seqs;
    for (int s = 0; s < 48; ++s) { seqs.push_back({static_cast<int>(rand_int(rng, 1, 700)), 1}); }  // decodes
    seqs.push_back({40, 16});                                                                       // a prefill
    const AttnCase c(rng, 2, 4, 64, 16, seqs);
    REQUIRE(c.n_tokens == 64);
    AttnDev    d(c);
    const auto full = d.run(c, 64);
    const size_t row = static_cast<size_t>(c.n_kv * c.group * c.hd);
    int64_t      mismatched = 0;
    for (int64_t n = 1; n <= 64; ++n) {
        const auto part = d.run(c, n);
        mismatched += bitwise_equal(part.data(), full.data(), static_cast<size_t>(n) * row) ? 0 : 1;
    }
    CHECK(mismatched == 0);
}

TEST_CASE("cuda kv_store writes each token's K and V at its slot, as the CPU kv_store") {
    std::mt19937  rng(9);
    const int64_t n_blocks = 20, bs = 16, n_kv = 3, hd = 40, n = 50, row = n_kv * hd;
    auto          k = randv(rng, static_cast<size_t>(n_blocks * bs * row)), v = randv(rng, k.size());
    const auto    kn = randv(rng, static_cast<size_t>(n * row)), vn = randv(rng, kn.size());
    std::vector<int64_t> all(static_cast<size_t>(n_blocks * bs));
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng);
    const std::vector<int64_t> slots(all.begin(), all.begin() + n);
    DevBuf<float>   dk(k), dv(v), dkn(kn), dvn(vn);
    DevBuf<int64_t> ds(slots);
    const auto i32 = [](int64_t x) { return static_cast<int32_t>(x); };
    KC::kv_store(K::PagedKv{dk.get(), dv.get(), i32(bs), i32(n_kv), i32(hd)}, dkn.get(), dvn.get(), ds.get(), n, nullptr);
    K::kv_store(K::PagedKv{k.data(), v.data(), i32(bs), i32(n_kv), i32(hd)}, kn.data(), vn.data(), slots.data(), n);
    CHECK(dk.download() == k);
    CHECK(dv.download() == v);
}
