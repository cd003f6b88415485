// Expert parallelism's dispatch/combine (fd/model/moe_ep.h) against the tp = 1 kernel
// (Backend::moe_experts over every expert): the output is BITWISE the same on every rank, at
// ep = 2 and 4, over the shm comm between fork()ed ranks that hold only their own experts, for
// f32 and bf16 experts, skewed routing included (one rank owning most pairs, another none).
// The pair ranges each rank owns are checked against a hand count.
#include "fd/comm/comm.h"
#include "fd/kernels/backend.h"
#include "fd/kernels/moe.h"
#include "fd/model/moe_ep.h"

#include "../../fork_ranks.h"

#include <doctest/doctest.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

using namespace fd;

namespace {

struct Case {
    int32_t E = 8, top_k = 2;
    int64_t n = 13, h = 32, ff = 24;
    bool    bf16 = false;
    bool    skew = false;  ///< logits favour the first experts: rank 0 owns most pairs
};

std::vector<uint16_t> to_bf16(const std::vector<float> & v) {
    std::vector<uint16_t> o(v.size());
    for (size_t i = 0; i < v.size(); ++i) {
        uint32_t u;
        std::memcpy(&u, &v[i], 4);
        o[i] = static_cast<uint16_t>(u >> 16);
    }
    return o;
}

/// Runs the case; returns the number of ranks whose output differs from the tp = 1 kernel's.
int run_case(const Case & c, int ep) {
    std::mt19937 g(5 + c.E + ep + c.skew);
    std::normal_distribution<float> nd(0.0f, 0.5f);
    auto randv = [&](int64_t k) {
        std::vector<float> v(static_cast<size_t>(k));
        for (auto & x : v) { x = nd(g); }
        return v;
    };
    std::vector<std::vector<float>> gu, dn;
    std::vector<std::vector<uint16_t>> gu16, dn16;
    std::vector<kernels::ExpertWeights> all(static_cast<size_t>(c.E));
    for (int e = 0; e < c.E; ++e) {
        gu.push_back(randv(2 * c.ff * c.h));
        dn.push_back(randv(c.h * c.ff));
        gu16.push_back(to_bf16(gu.back()));
        dn16.push_back(to_bf16(dn.back()));
    }
    for (int e = 0; e < c.E; ++e) {
        const auto t = c.bf16 ? kernels::WType::bf16 : kernels::WType::f32;
        all[e] = c.bf16 ? kernels::ExpertWeights{gu16[e].data(), t, dn16[e].data(), t} : kernels::ExpertWeights{gu[e].data(), t, dn[e].data(), t};
    }
    const auto x = randv(c.n * c.h);
    auto logits = randv(c.n * c.E);
    if (c.skew) {
        for (int64_t t = 0; t < c.n; ++t) { logits[t * c.E] += 4.0f; logits[t * c.E + 1] += 4.0f; }
    }
    std::vector<int32_t> ids(static_cast<size_t>(c.n * c.top_k));
    std::vector<float> w(ids.size());
    kernels::moe_route(ids.data(), w.data(), logits.data(), c.n, c.E, c.top_k, true);
    const kernels::MoePlan plan = kernels::moe_plan(ids.data(), w.data(), c.n, c.top_k, c.E);
    // The pair ranges: rank r owns the pairs whose expert is in [r*E/ep, (r+1)*E/ep).
    const auto first = model::moe_ep_rank_pairs(plan, c.E, ep);
    for (int r = 0; r < ep; ++r) {
        int64_t count = 0;
        for (int32_t id : ids) { count += id / (c.E / ep) == r; }
        CHECK(first[r + 1] - first[r] == count);
    }
    auto be = kernels::make_backend({.kind = kernels::DeviceKind::cpu, .n_threads = 1});
    std::vector<float> ref(static_cast<size_t>(c.n * c.h)), work(static_cast<size_t>(kernels::Backend::moe_work_floats(plan.max_rows, c.h, c.ff)));
    be->moe_experts(ref.data(), x.data(), plan, all.data(), c.n, c.h, c.ff, work.data());
    comm::ShmCommSegment seg(ep, 1);
    return fd::testing::run_forked_ranks(ep, [&](int r) {
        auto cm = comm::make_shm_comm({.rank = r, .world_size = ep, .segment_fd = [&](int64_t) { return ::dup(seg.fd()); }, .timeout_s = 20});
        cm->connect(1);
        std::vector<kernels::ExpertWeights> mine(static_cast<size_t>(c.E));  // only this rank's experts
        for (int e = r * c.E / ep; e < (r + 1) * c.E / ep; ++e) { mine[e] = all[e]; }
        const model::MoeEpCall call{.plan = plan, .experts = mine.data(), .n_experts = c.E, .ep = ep, .ep_rank = r, .n_rows = c.n,
                                    .n_embd = c.h, .n_ff = c.ff};
        auto rb = kernels::make_backend({.kind = kernels::DeviceKind::cpu, .n_threads = 1});
        std::vector<float> out(ref.size(), 7.0f), wk(work.size()), buf(static_cast<size_t>(model::moe_ep_buffer_floats(call)));
        model::moe_experts_ep(*rb, *cm, call, out.data(), x.data(), wk.data(), buf.data());
        cm->disconnect();
        return std::memcmp(out.data(), ref.data(), ref.size() * sizeof(float)) == 0 ? 0 : 1;
    });
}

}  // namespace

TEST_CASE("moe_experts_ep: bitwise the tp=1 kernel on every rank, ep 2 and 4, f32 and bf16, balanced and skewed routing") {
    for (const int ep : {2, 4}) {
        for (const bool bf16 : {false, true}) {
            for (const bool skew : {false, true}) {
                CAPTURE(ep);
                CAPTURE(bf16);
                CAPTURE(skew);
                CHECK(run_case({.E = 8, .top_k = 3, .n = 17, .h = 32, .ff = 24, .bf16 = bf16, .skew = skew}, ep) == 0);
            }
        }
    }
    CHECK(run_case({.E = 4, .top_k = 1, .n = 1, .h = 16, .ff = 8}, 2) == 0);  // one token: one rank has no pair
}
