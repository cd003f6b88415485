// The MTP cache travels with the target's KV through the host swap pool (daemon/src/model/
// worker.cpp swap_out / swap_out_background / swap_in; fd/model/worker.h's swap pool layout).
// A sequence is prefilled (its MTP cache caught up), swapped out, its device blocks overwritten
// by another sequence (target KV and MTP cache), swapped into OTHER block ids, and decoded with an
// MTP draft chain. The reference is a Worker of the same build that never swaps: the step's
// logits and the chain's drafts must be equal (bitwise / token for token). Without the MTP
// blocks in the swap pool the chain would attend over the other sequence's (or zeroed) MTP
// K/V and draft differently. Random tiny-mimo (a random MTP layer: its drafts move with any
// change of its context), synchronous and background swap-out, f32 and bf16 target KV. At tp 2 the same on
// both ranks (fork()ed, Gloo on loopback): each rank swaps its kv heads' half of the MTP K/V.
#include "fd/checkpoint/model_config.h"
#include "fd/model/worker.h"
#include "fd/comm/comm.h"
#include "fd/comm/tcp_store.h"
#include "../unit/test_util.h"
#include "../fork_ranks.h"

#include <doctest/doctest.h>

#include <filesystem>
#include <numeric>
#include <vector>

namespace fs = std::filesystem;
using namespace fd;

namespace {

constexpr int32_t kBlock = 4;   // tokens per block: the prompt spans several
constexpr int32_t kDrafts = 4;  // chain length: past the sequence's blocks (scratch) too
constexpr int32_t kLen = 19;    // prompt tokens

model::WorkerConfig wcfg(kernels::WType kv_dtype, int32_t rank = 0, int32_t tp = 1) {
    return {.rank = rank, .tp_size = tp, .n_threads = tp > 1 ? 1 : 2, .block_size = kBlock, .n_blocks = 24, .n_swap_blocks = 8, .kv_dtype = kv_dtype, .max_model_len = 64,
            .mtp_draft_tokens = kDrafts, .mtp_scratch_blocks = 2 * ((kDrafts + kBlock - 1) / kBlock + 1)};
}

std::vector<int32_t> tokens(int32_t mul, int32_t add, int32_t vocab) {
    std::vector<int32_t> t(kLen + 1);
    for (int32_t i = 0; i <= kLen; ++i) { t[static_cast<size_t>(i)] = (mul * i + add) % vocab; }
    return t;
}

/// Positions [from, to) of `toks` on blocks `table` through forward(), then the MTP catch-up of
/// every row (its next token toks[pos + 1]) and, if `chain`, a chain of kDrafts from the last
/// row. Returns the last row's logits, then the drafts (as floats), concatenated.
std::vector<float> step(model::Worker & w, const std::vector<int32_t> & toks, const std::vector<int32_t> & table, int32_t from,
                        int32_t to, bool chain) {
    model::StepBatch s;
    model::DraftBatch db;
    for (int32_t pos = from; pos < to; ++pos) {
        const int64_t slot = int64_t{table[static_cast<size_t>(pos / kBlock)]} * kBlock + pos % kBlock;
        s.tokens.push_back(toks[static_cast<size_t>(pos)]);
        s.positions.push_back(pos);
        s.slots.push_back(slot);
        s.queries.push_back({table.data(), pos + 1});
        db.hidden_rows.push_back(pos - from);
        db.tokens.push_back(toks[static_cast<size_t>(pos) + 1]);
        db.positions.push_back(pos);
        db.slots.push_back(slot);
        db.queries.push_back({table.data(), pos + 1});
    }
    s.logits_rows.push_back(to - from - 1);
    std::vector<float> out(static_cast<size_t>(w.config().vocab_size));
    REQUIRE(w.forward(s, out.data()));
    if (chain) {
        db.chains.push_back({.row = to - from - 1, .k = kDrafts, .block_table = table.data(),
                             .n_table_blocks = static_cast<int32_t>(table.size())});
    }
    std::vector<int32_t> drafts;
    w.draft_mtp(db, drafts);
    out.insert(out.end(), drafts.begin(), drafts.end());
    return out;
}

std::vector<int32_t> blocks(int32_t first, int32_t n) {
    std::vector<int32_t> t(static_cast<size_t>(n));
    std::iota(t.begin(), t.end(), first);
    return t;
}

struct SwapRun {
    std::vector<float> want, got;  ///< [vocab + kDrafts]: the last row's logits, then the drafts
    int64_t            swap_bytes = 0;
};

/// The scenario on rank `rank` of `tp` (comm: nullptr at tp 1): `want` from a Worker that never
/// swaps, `got` from one whose sequence went through the host pool into other blocks.
SwapRun swap_run(const fs::path & ck, kernels::WType kv_dtype, bool background, int32_t rank = 0, int32_t tp = 1,
                 comm::Comm * comm = nullptr) {
    const auto cfg = model::load_model_config(ck);
    const auto idx = model::read_tensor_index(ck);
    const int32_t vocab = cfg.vocab_size, n_tab = (kLen + kDrafts) / kBlock + 1;
    const auto a = tokens(7, 3, vocab), b = tokens(13, 5, vocab);

    model::Worker ref(cfg, idx, wcfg(kv_dtype, rank, tp), comm);
    const auto ref_table = blocks(0, n_tab);
    step(ref, a, ref_table, 0, kLen - 1, false);
    const auto want = step(ref, a, ref_table, kLen - 1, kLen, true);
    REQUIRE(want.size() == static_cast<size_t>(vocab + kDrafts));

    model::Worker w(cfg, idx, wcfg(kv_dtype, rank, tp), comm);
    const auto first = blocks(0, n_tab);
    step(w, a, first, 0, kLen - 1, false);
    const int32_t n_full = (kLen - 1 + kBlock - 1) / kBlock;  // the blocks holding positions [0, kLen - 1)
    std::vector<kv::BlockCopy> out, in;
    for (int32_t i = 0; i < n_full; ++i) {
        out.push_back({.src = i, .dst = 7 - i});   // host blocks in another order
        in.push_back({.src = 7 - i, .dst = 10 + i});
    }
    if (background) {
        w.swap_out_background(out.data(), static_cast<int64_t>(out.size()));
        w.wait_copies();
    } else {
        w.swap_out(out.data(), static_cast<int64_t>(out.size()));
    }
    step(w, b, first, 0, kLen - 1, true);  // another sequence on the same blocks (and scratch)
    w.swap_in(in.data(), static_cast<int64_t>(in.size()));
    const auto moved = blocks(10, n_tab);
    return {.want = want, .got = step(w, a, moved, kLen - 1, kLen, true), .swap_bytes = w.swap_bytes()};
}

void check(const fs::path & ck, kernels::WType kv_dtype, bool background) {
    const auto cfg = model::load_model_config(ck);
    const int32_t vocab = cfg.vocab_size;
    const auto [want, got, swap_bytes] = swap_run(ck, kv_dtype, background);
    CHECK(test::bits_equal(std::vector<float>(got.begin(), got.begin() + vocab), std::vector<float>(want.begin(), want.begin() + vocab)));
    CHECK(std::vector<float>(got.begin() + vocab, got.end()) == std::vector<float>(want.begin() + vocab, want.end()));

    // The pool's host block holds the MTP cache's block too.
    CHECK(swap_bytes >= 8 * model::Worker::swap_block_bytes(cfg, kBlock, 1, kv_dtype, true));
    CHECK(model::Worker::swap_block_bytes(cfg, kBlock, 1, kv_dtype, true) ==
          model::Worker::kv_block_bytes(cfg, kBlock, 1, kv_dtype) + 2 * kBlock * cfg.kv_dim() * 4);
}

}  // namespace

TEST_SUITE("model::mtp_swap") {
    TEST_CASE("a swapped-out sequence's MTP cache comes back with its KV: the drafts equal a run without the swap") {
        test::TempDir d;
        fd::test::make_random_checkpoint(d.path / "m", "--preset tiny-mimo --seed 3");
        for (const auto dtype : {kernels::WType::f32, kernels::WType::bf16}) {
            for (const bool background : {false, true}) {
                CAPTURE(static_cast<int>(dtype));
                CAPTURE(background);
                check(d.path / "m", dtype, background);
            }
        }
    }

    TEST_CASE("tp 2: each rank's half of the MTP cache comes back with its KV (drafts equal a run without the swap on every rank)") {
        // Each rank holds its kv heads' half of the MTP K/V in its own swap pool; a rank that
        // lost its half would attend over the other sequence's, and the all-reduced draft
        // logits (hence the drafts on both ranks) would move. Real Gloo over loopback.
        test::TempDir d;
        fd::test::make_random_checkpoint(d.path / "m", "--preset tiny-mimo --seed 3");
        const int32_t vocab = model::load_model_config(d.path / "m").vocab_size;
        for (const bool background : {false, true}) {
            CAPTURE(background);
            comm::TcpStoreServer store("127.0.0.1", 0);
            const int failed = fd::testing::run_forked_ranks(2, [&](int r) {
                auto comm = comm::make_gloo_comm({.rank = r, .world_size = 2, .store_port = store.port(), .timeout_s = 60});
                comm->connect(1);
                const auto run = swap_run(d.path / "m", kernels::WType::f32, background, r, 2, comm.get());
                const std::vector<float> got(run.got.begin(), run.got.begin() + vocab), want(run.want.begin(), run.want.begin() + vocab);
                const bool logits = r != 0 || test::bits_equal(got, want);  // (the logits are gathered to rank 0)
                const bool drafts = std::equal(run.got.begin() + vocab, run.got.end(), run.want.begin() + vocab, run.want.end());
                if (!logits || !drafts) { std::fprintf(stderr, "rank %d: logits equal %d, drafts equal %d\n", r, logits, drafts); }
                comm->barrier();
                return logits && drafts ? 0 : 1;
            });
            CHECK(failed == 0);
        }
    }
}
