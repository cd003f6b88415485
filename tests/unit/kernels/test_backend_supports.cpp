// Backend::supports (kernels/backend.cpp; ggml's supports_op): what the CPU backend (the oracle)
// says it runs, it runs — each claim is exercised here, a refused one fails the way the claim
// says — and the Worker refuses, at load, a layout whose matrices a backend's kernels cannot read.
// References: IEEE 754 / bfloat16 encodings (a quiet NaN is 0x7FC00000 in binary32, 0x7FC0 in
// bfloat16 — its upper half —, 0x7E00 in binary16), and bf16-exact weights, whose bf16 linear
// must equal the f32 one bit for bit.
#include "fd/kernels/backend.h"
#include "fd/status.h"

#include <doctest/doctest.h>

#include <cstring>
#include <limits>
#include <string>
#include <vector>

namespace k = fd::kernels;
using fd::DType;

TEST_SUITE("kernels::backend_supports") {

TEST_CASE("the CPU oracle's table: weights in f32/bf16, activations in f32, scans in every dtype, no graphs") {
    auto be = k::make_backend({.kind = k::DeviceKind::cpu, .n_threads = 1});
    for (k::BackendOp op : {k::BackendOp::embedding, k::BackendOp::linear, k::BackendOp::moe_experts}) {
        CAPTURE(k::backend_op_name(op));
        CHECK(be->supports(op, DType::f32));
        CHECK(be->supports(op, DType::bf16));
        CHECK_FALSE(be->supports(op, DType::f16));  // F16 checkpoints are widened to f32 at load
    }
    for (k::BackendOp op : {k::BackendOp::rms_norm, k::BackendOp::rope, k::BackendOp::silu_mul, k::BackendOp::add,
                            k::BackendOp::copy_rows, k::BackendOp::gather_rows, k::BackendOp::kv_store, k::BackendOp::attention_paged,
                            k::BackendOp::scale_add_rows, k::BackendOp::log_softmax_rows, k::BackendOp::argmax_rows}) {
        CAPTURE(k::backend_op_name(op));
        CHECK(be->supports(op, DType::f32));
        CHECK_FALSE(be->supports(op, DType::bf16));
    }
    for (DType d : {DType::f32, DType::bf16, DType::f16}) { CHECK(be->supports(k::BackendOp::find_nonfinite, d)); }
    CHECK_FALSE(be->supports(k::BackendOp::graph_capture, DType::f32));
    // Every op has a name, and the names are distinct.
    std::vector<std::string> names;
    for (int i = 0; i < k::kBackendOpCount; ++i) { names.emplace_back(k::backend_op_name(static_cast<k::BackendOp>(i))); }
    for (size_t i = 0; i < names.size(); ++i) {
        CHECK(names[i] != "?");
        for (size_t j = 0; j < i; ++j) { CHECK(names[i] != names[j]); }
    }
    CHECK(names.back() == "graph_capture");
}

TEST_CASE("the claims hold: bf16 linear equals f32 on bf16-exact weights, every dtype's NaN is found, capture refused") {
    auto be = k::make_backend({.kind = k::DeviceKind::cpu, .n_threads = 1});
    // x [2, 3], W [2, 3] with values exact in bf16 (8 significant bits).
    const std::vector<float> x = {1.0f, -2.0f, 0.5f, 3.0f, 0.25f, -1.5f};
    const std::vector<float> w = {0.5f, -1.25f, 2.0f, 0.75f, 1.5f, -0.125f};
    std::vector<uint16_t> w16(w.size());
    for (size_t i = 0; i < w.size(); ++i) {
        uint32_t u;
        std::memcpy(&u, &w[i], 4);
        REQUIRE((u & 0xFFFFu) == 0);  // exact in bf16
        w16[i] = static_cast<uint16_t>(u >> 16);
    }
    REQUIRE(be->supports(k::BackendOp::linear, DType::bf16));
    std::vector<float> out32(4), out16(4);
    be->linear(out32.data(), x.data(), w.data(), DType::f32, nullptr, 2, 2, 3);
    be->linear(out16.data(), x.data(), w16.data(), DType::bf16, nullptr, 2, 2, 3);
    // By hand: row 0 · W0 = 0.5 + 2.5 + 1 = 4, row 0 · W1 = 0.75 - 3 - 0.0625 = -2.3125, ...
    CHECK(out32[0] == 4.0f);
    CHECK(out32[1] == -2.3125f);
    CHECK(std::memcmp(out32.data(), out16.data(), sizeof(float) * 4) == 0);

    // find_nonfinite, claimed for all three dtypes: the NaN at index 2 is found in each.
    const float nan = std::numeric_limits<float>::quiet_NaN();
    const std::vector<float> f = {1.0f, 2.0f, nan, 4.0f};
    const std::vector<uint16_t> b = {0x3F80, 0x4000, 0x7FC0, 0x4080};  // 1, 2, NaN, 4 in bfloat16
    const std::vector<uint16_t> h = {0x3C00, 0x4000, 0x7E00, 0x4400};  // 1, 2, NaN, 4 in binary16
    CHECK(be->find_nonfinite(f.data(), DType::f32, 4) == 2);
    CHECK(be->find_nonfinite(b.data(), DType::bf16, 4) == 2);
    CHECK(be->find_nonfinite(h.data(), DType::f16, 4) == 2);
    CHECK(be->find_nonfinite(h.data(), DType::f16, 2) == -1);

    // graph_capture refused: the calls fail with internal, as the table says.
    try {
        be->begin_capture();
        FAIL("the CPU backend began a capture");
    } catch (const fd::Error & e) {
        CHECK(e.code() == fd::Errc::internal);
    }
}

}  // TEST_SUITE
