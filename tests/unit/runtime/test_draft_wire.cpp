// The MTP draft batch on the multi-process link (daemon/src/runtime/draft_wire.h): a DraftBatch
// survives the shared region unchanged — rows, chains and every block table, a table shared by a
// sequence's rows and its chain written once, as long as its longest use — rank 0's drafts land
// where the daemon reads them, a region too small gets nothing written, and a batch received
// inline whose header counts more than arrived (or a negative count) is refused, as is a table
// offset outside the tables.
#include "fd/runtime/rank_link.h"
#include "fd/status.h"

#include "../../../daemon/src/runtime/draft_wire.h"

#include <doctest/doctest.h>

#include <cstring>
#include <vector>

using namespace fd;
using namespace fd::runtime;

namespace {

/// Sequence a: 3 catch-up rows over blocks {7, 2} and a chain of k 3 whose table is 4 blocks
/// long (the rows' contexts need 2); sequence b: 1 row over {5} and a chain of k 1 over {5, 6}.
struct Batch {
    int32_t table_a[4] = {7, 2, 11, 12};
    int32_t table_b[2] = {5, 6};
    model::DraftBatch db;
    Batch() {
        for (int32_t p = 3; p < 6; ++p) {
            db.hidden_rows.push_back(p - 3);
            db.tokens.push_back(100 + p);
            db.positions.push_back(p);
            db.slots.push_back((p < 4 ? 7 : 2) * 4 + p % 4);
            db.queries.push_back({table_a, p + 1});
        }
        db.hidden_rows.push_back(4);
        db.tokens.push_back(42);
        db.positions.push_back(2);
        db.slots.push_back(5 * 4 + 2);
        db.queries.push_back({table_b, 3});
        db.chains.push_back({.row = 2, .k = 3, .block_table = table_a, .n_table_blocks = 4});
        db.chains.push_back({.row = 3, .k = 1, .block_table = table_b, .n_table_blocks = 2});
    }
};

}  // namespace

TEST_SUITE("runtime::draft_wire") {
    TEST_CASE("a draft batch round-trips through the shared region; rank 0's drafts come back") {
        Batch s;
        const int32_t bs = 4;
        std::vector<DraftRun> runs;
        SharedRegion region;
        region.create(64);
        const int64_t need = draft_encode(region.data(), 64, s.db, bs, runs);  // too small: sizes only
        CHECK(need == draft_layout(4, 2, 4 + 2, 4).total_bytes);          // tables: a's 4 blocks, b's 2, once each
        region.resize(need);
        REQUIRE(draft_encode(region.data(), region.bytes(), s.db, bs, runs) == need);

        model::DraftBatch got;
        draft_decode(region.data(), got, bs);
        CHECK(got.hidden_rows == s.db.hidden_rows);
        CHECK(got.tokens == s.db.tokens);
        CHECK(got.positions == s.db.positions);
        CHECK(got.slots == s.db.slots);
        REQUIRE(got.queries.size() == 4);
        for (size_t i = 0; i < 4; ++i) {
            CHECK(got.queries[i].n_ctx == s.db.queries[i].n_ctx);
            for (int32_t b = 0; b < (got.queries[i].n_ctx + bs - 1) / bs; ++b) {
                CHECK(got.queries[i].block_table[b] == s.db.queries[i].block_table[b]);
            }
        }
        REQUIRE(got.chains.size() == 2);
        for (size_t c = 0; c < 2; ++c) {
            const auto & w = s.db.chains[c];
            CHECK((got.chains[c].row == w.row && got.chains[c].k == w.k && got.chains[c].n_table_blocks == w.n_table_blocks));
            for (int32_t b = 0; b < w.n_table_blocks; ++b) { CHECK(got.chains[c].block_table[b] == w.block_table[b]); }
        }
        CHECK(got.chains[0].block_table == got.queries[0].block_table);  // one run per sequence
        // The drafts start as -1 (an unwritten chain ends at once); rank 0's writes are read back.
        int32_t * out = draft_out(region.data());
        CHECK(std::vector<int32_t>(out, out + 4) == std::vector<int32_t>{-1, -1, -1, -1});
        const int32_t drafts[4] = {9, 8, 7, 6};
        std::memcpy(out, drafts, sizeof drafts);
        CHECK(draft_out(region.data())[3] == 6);
        CHECK(reinterpret_cast<char *>(out) - static_cast<char *>(region.data()) == draft_layout(4, 2, 6, 4).drafts);
    }

    TEST_CASE("an inline draft batch is checked against what arrived; bad tables are refused") {
        Batch s;
        const int32_t bs = 4;
        std::vector<DraftRun> runs;
        const int64_t total = draft_encode(nullptr, 0, s.db, bs, runs);
        std::vector<int64_t> buf(static_cast<size_t>(total + 7) / 8);
        REQUIRE(draft_encode(buf.data(), total, s.db, bs, runs) == total);
        const int64_t n = draft_layout(4, 2, 6, 4).drafts;  // what travels: everything before the drafts
        CHECK_NOTHROW(check_inline_draft(buf.data(), n));
        CHECK_THROWS_WITH_AS(check_inline_draft(buf.data(), n - 1), doctest::Contains("does not hold"), fd::Error);
        CHECK_THROWS_WITH_AS(check_inline_draft(buf.data(), 8), doctest::Contains("header"), fd::Error);
        DraftHeader h;
        std::memcpy(static_cast<void *>(&h), buf.data(), sizeof h);  // trivially copyable; its member defaults make GCC warn
        DraftHeader bad = h;
        bad.n_chains = -1;
        std::memcpy(buf.data(), &bad, sizeof bad);
        CHECK_THROWS_WITH_AS(check_inline_draft(buf.data(), n), doctest::Contains("does not hold"), fd::Error);
        std::memcpy(buf.data(), &h, sizeof h);
        // A chain whose table runs past the tables: refused by the decode.
        auto * c_len = reinterpret_cast<int32_t *>(reinterpret_cast<char *>(buf.data()) + draft_layout(4, 2, 6, 4).chain_blocks);
        c_len[1] = 5;
        model::DraftBatch got;
        CHECK_THROWS_WITH_AS(draft_decode(buf.data(), got, bs), doctest::Contains("outside its 6 table entries"), fd::Error);
        // A chain with k 0 is refused before anything is written.
        s.db.chains[1].k = 0;
        CHECK_THROWS_AS(draft_encode(buf.data(), total, s.db, bs, runs), fd::Error);
    }
}
