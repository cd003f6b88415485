// An MTP draft batch in the shared region (draft_wire.h).
#include "draft_wire.h"

#include "fd/status.h"

#include <algorithm>
#include <cstring>

namespace fd::runtime {
namespace {

int64_t align64(int64_t x) { return (x + 63) / 64 * 64; }

template <typename T>
T * at(void * region, int64_t off) { return reinterpret_cast<T *>(static_cast<char *>(region) + off); }
template <typename T>
const T * at(const void * region, int64_t off) { return reinterpret_cast<const T *>(static_cast<const char *>(region) + off); }

int32_t blocks_of(int32_t n_ctx, int32_t block_size) { return (n_ctx + block_size - 1) / block_size; }

/// The run of `table` in `runs` (appended when new), grown to `blocks`. Rows of one sequence are
/// adjacent and chains follow the rows' order, so the last run is nearly always the one.
DraftRun & run_of(std::vector<DraftRun> & runs, const int32_t * table, int32_t blocks) {
    for (size_t i = runs.size(); i-- > 0;) {
        if (runs[i].table == table) {
            runs[i].blocks = std::max(runs[i].blocks, blocks);
            return runs[i];
        }
    }
    runs.push_back({table, blocks, 0});
    return runs.back();
}

}  // namespace

DraftLayout draft_layout(int64_t n_rows, int64_t n_chains, int64_t n_tables, int64_t n_drafts) {
    DraftLayout l;
    int64_t off = align64(sizeof(DraftHeader));
    auto take = [&](int64_t & field, int64_t bytes) {
        field = off;
        off   = align64(off + bytes);
    };
    take(l.hidden_rows, n_rows * 4);
    take(l.tokens, n_rows * 4);
    take(l.positions, n_rows * 4);
    take(l.slots, n_rows * 8);
    take(l.q_table, n_rows * 4);
    take(l.q_ctx, n_rows * 4);
    take(l.chain_row, n_chains * 4);
    take(l.chain_k, n_chains * 4);
    take(l.chain_table, n_chains * 4);
    take(l.chain_blocks, n_chains * 4);
    take(l.tables, n_tables * 4);
    take(l.drafts, n_drafts * 4);
    l.total_bytes = off;
    return l;
}

int64_t draft_encode(void * region, int64_t region_bytes, const model::DraftBatch & db, int32_t block_size,
                     std::vector<DraftRun> & runs) {
    const int64_t n = static_cast<int64_t>(db.hidden_rows.size()), m = static_cast<int64_t>(db.chains.size());
    FD_CHECK(static_cast<int64_t>(db.tokens.size()) == n && static_cast<int64_t>(db.positions.size()) == n &&
                 static_cast<int64_t>(db.slots.size()) == n && static_cast<int64_t>(db.queries.size()) == n,
             "draft batch arrays of different lengths");
    runs.clear();
    int64_t n_drafts = 0;
    for (int64_t i = 0; i < n; ++i) { run_of(runs, db.queries[i].block_table, blocks_of(db.queries[i].n_ctx, block_size)); }
    for (const auto & c : db.chains) {
        FD_CHECK(c.k >= 1 && c.row >= 0 && c.row < n && c.n_table_blocks >= 0, "MTP chain row {} / k {} invalid", c.row, c.k);
        run_of(runs, c.block_table, c.n_table_blocks);
        n_drafts += c.k;
    }
    int32_t n_tables = 0;
    for (auto & r : runs) {
        r.offset = n_tables;
        n_tables += r.blocks;
    }
    const DraftLayout l = draft_layout(n, m, n_tables, n_drafts);
    if (l.total_bytes > region_bytes) { return l.total_bytes; }
    auto * h    = static_cast<DraftHeader *>(region);
    h->n_rows   = static_cast<int32_t>(n);
    h->n_chains = static_cast<int32_t>(m);
    h->n_tables = n_tables;
    h->n_drafts = static_cast<int32_t>(n_drafts);
    std::memcpy(at<int32_t>(region, l.hidden_rows), db.hidden_rows.data(), n * 4);
    std::memcpy(at<int32_t>(region, l.tokens), db.tokens.data(), n * 4);
    std::memcpy(at<int32_t>(region, l.positions), db.positions.data(), n * 4);
    std::memcpy(at<int64_t>(region, l.slots), db.slots.data(), n * 8);
    int32_t * tables = at<int32_t>(region, l.tables);  // each run's block ids once; its offset replaces the pointer
    for (const auto & r : runs) {
        if (r.blocks > 0) { std::memcpy(tables + r.offset, r.table, static_cast<size_t>(r.blocks) * 4); }
    }
    int32_t * q_table = at<int32_t>(region, l.q_table);
    int32_t * q_ctx   = at<int32_t>(region, l.q_ctx);
    for (int64_t i = 0; i < n; ++i) {
        q_table[i] = run_of(runs, db.queries[i].block_table, 0).offset;
        q_ctx[i]   = db.queries[i].n_ctx;
    }
    int32_t * c_row = at<int32_t>(region, l.chain_row);
    int32_t * c_k   = at<int32_t>(region, l.chain_k);
    int32_t * c_tab = at<int32_t>(region, l.chain_table);
    int32_t * c_len = at<int32_t>(region, l.chain_blocks);
    for (int64_t c = 0; c < m; ++c) {
        const auto & ch = db.chains[static_cast<size_t>(c)];
        c_row[c] = ch.row;
        c_k[c]   = ch.k;
        c_tab[c] = run_of(runs, ch.block_table, 0).offset;
        c_len[c] = ch.n_table_blocks;
    }
    std::fill_n(at<int32_t>(region, l.drafts), n_drafts, -1);
    return l.total_bytes;
}

void draft_decode(const void * region, model::DraftBatch & db, int32_t block_size) {
    const auto * h = static_cast<const DraftHeader *>(region);
    const int64_t n = h->n_rows, m = h->n_chains, nt = h->n_tables;
    FD_CHECK(n >= 0 && m >= 0 && nt >= 0 && h->n_drafts >= 0, "draft batch with a negative count");
    const DraftLayout l = draft_layout(n, m, nt, h->n_drafts);
    const int32_t * tables = at<int32_t>(region, l.tables);
    auto table = [&](int32_t off, int64_t blocks) {
        if (off < 0 || blocks < 0 || off + blocks > nt) {
            fail(Errc::invalid_argument, "draft batch: block table [{}, +{}) outside its {} table entries", off, blocks, nt);
        }
        return tables + off;
    };
    const int32_t * rows = at<int32_t>(region, l.hidden_rows);
    const int32_t * tok  = at<int32_t>(region, l.tokens);
    const int32_t * pos  = at<int32_t>(region, l.positions);
    const int64_t * slot = at<int64_t>(region, l.slots);
    const int32_t * qt   = at<int32_t>(region, l.q_table);
    const int32_t * qc   = at<int32_t>(region, l.q_ctx);
    db.hidden_rows.assign(rows, rows + n);
    db.tokens.assign(tok, tok + n);
    db.positions.assign(pos, pos + n);
    db.slots.assign(slot, slot + n);
    db.queries.resize(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
        db.queries[static_cast<size_t>(i)] = {table(qt[i], qc[i] > 0 ? blocks_of(qc[i], block_size) : 0), qc[i]};
    }
    const int32_t * c_row = at<int32_t>(region, l.chain_row);
    const int32_t * c_k   = at<int32_t>(region, l.chain_k);
    const int32_t * c_tab = at<int32_t>(region, l.chain_table);
    const int32_t * c_len = at<int32_t>(region, l.chain_blocks);
    db.chains.resize(static_cast<size_t>(m));
    int64_t n_drafts = 0;
    for (int64_t c = 0; c < m; ++c) {
        db.chains[static_cast<size_t>(c)] = {.row = c_row[c], .k = c_k[c], .block_table = table(c_tab[c], c_len[c]),
                                             .n_table_blocks = c_len[c]};
        n_drafts += c_k[c];
    }
    FD_CHECK(n_drafts == h->n_drafts, "draft batch: chains want {} drafts, the header says {}", n_drafts, h->n_drafts);
}

int32_t * draft_out(void * region) {
    const auto * h = static_cast<const DraftHeader *>(region);
    return at<int32_t>(region, draft_layout(h->n_rows, h->n_chains, h->n_tables, h->n_drafts).drafts);
}

void check_inline_draft(const void * data, int64_t n) {
    if (n < static_cast<int64_t>(sizeof(DraftHeader)) || data == nullptr) {
        fail(Errc::invalid_argument, "inline draft batch of {} bytes: shorter than its {}-byte header", n, sizeof(DraftHeader));
    }
    DraftHeader h;  // copied out: the bytes came from the network
    std::memcpy(&h, data, sizeof h);
    if (h.n_rows < 0 || h.n_chains < 0 || h.n_tables < 0 || h.n_drafts < 0 ||
        draft_layout(h.n_rows, h.n_chains, h.n_tables, h.n_drafts).drafts > n) {
        fail(Errc::invalid_argument, "inline draft batch of {} bytes does not hold n_rows {}, n_chains {}, n_tables {}", n, h.n_rows,
             h.n_chains, h.n_tables);
    }
}

}  // namespace fd::runtime
