// Worker::apply_rank_delta / apply_hf_delta / undo_weight_delta (fd/model/worker.h): this rank's
// share of a sparse weight update (fd/weights/rank_delta.h: runs in the shard's coordinates, split
// by the daemon; or fd/weights/delta_pieces.h: split here from the mapped HF delta) written in place, with the old bytes of the same runs kept so that the executor can put every
// rank back when any one fails (the delta stream's all-or-nothing commit).
#include "fd/model/worker.h"

#include "fd/log.h"
#include "fd/status.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

namespace fd::model {

using memory::Tag;

namespace {

/// A delta failed part way: put back what it wrote (the error in flight is the one reported; a
/// failure of the undo itself is logged).
void undo_after_failed_delta(Worker & w, int32_t rank) {
    try {
        w.undo_weight_delta();
    } catch (const std::exception & e) {
        log::get("model")->error("rank {}: putting the old weights back after a failed delta failed too: {}", rank, e.what());
    }
}

/// TEST ONLY: FD_TEST_DELTA_FAIL_RANK=<rank> makes that rank fail half way through an apply
/// (after writing some tensors), to test the rollback of every rank; "<rank>:exit" makes that
/// rank's process exit there instead (a rank killed mid-apply; only for a rank process).
bool test_fail_here(int32_t rank) {
    const char * v = std::getenv("FD_TEST_DELTA_FAIL_RANK");
    return v && *v && std::atoi(v) == rank;
}

bool test_exit_here() {
    const char * v = std::getenv("FD_TEST_DELTA_FAIL_RANK");
    return v && std::strstr(v, ":exit") != nullptr;
}

std::string shape_text(const std::vector<int64_t> & s) {
    std::string out = "[";
    for (size_t i = 0; i < s.size(); ++i) { out += (i ? ", " : "") + std::to_string(s[i]); }
    return out + "]";
}

/// Swap `n` elements of `base` at `idx` [n] (element indices) with `vals` [n] (any alignment):
/// afterwards the tensor holds the values and `vals` the old ones. The element 64 swaps ahead is
/// prefetched (the indices are scattered over the tensor).
template <class Elem, class Index>
void swap_points(std::byte * base, const Index * idx, int64_t n, std::byte * vals) {
    Elem * w = reinterpret_cast<Elem *>(base);
    constexpr int64_t kAhead = 64;
    for (int64_t k = 0; k < n; ++k) {
        if (k + kAhead < n) { __builtin_prefetch(w + idx[k + kAhead], 1); }
        Elem v;
        std::memcpy(&v, vals + k * static_cast<int64_t>(sizeof(Elem)), sizeof(Elem));
        const Elem old = w[idx[k]];
        w[idx[k]] = v;
        std::memcpy(vals + k * static_cast<int64_t>(sizeof(Elem)), &old, sizeof(Elem));
    }
}

/// swap_points for elements of `es` bytes (4, 2 or 1). Errors  internal for another size.
template <class Index>
void swap_elements(int64_t es, std::byte * base, const Index * idx, int64_t n, std::byte * vals) {
    switch (es) {
    case 4: return swap_points<uint32_t>(base, idx, n, vals);
    case 2: return swap_points<uint16_t>(base, idx, n, vals);
    case 1: return swap_points<uint8_t>(base, idx, n, vals);
    default: fail(Errc::internal, "a one-element delta run of {}-byte elements", es);
    }
}

/// Every run of `t` one element (no lens): swap the tensor's elements at the starts with `vals`
/// [t.n_runs()] (afterwards `vals` holds the old values: the undo log needs no copy of its own).
void swap_in_place(const weights::RankDeltaTensor & t, int64_t es, std::byte * base, std::byte * vals) {
    swap_elements(es, base, t.starts.data(), t.n_runs(), vals);
}

/// Write `t`'s runs into `base` from `src` and save what was there into `save` (both
/// [t.n_values()] elements; `save` may be nullptr when nothing is kept).
void write_runs(const weights::RankDeltaTensor & t, int64_t es, std::byte * base, const std::byte * src, std::byte * save) {
    int64_t at = 0;
    for (int64_t i = 0; i < t.n_runs(); ++i) {
        const size_t n = static_cast<size_t>(t.run_len(i) * es);
        std::byte * dst = base + t.starts[static_cast<size_t>(i)] * es;
        if (save) { std::memcpy(save + at, dst, n); }
        std::memcpy(dst, src + at, n);
        at += static_cast<int64_t>(n);
    }
}

/// One frame of a delta landing swapped in (or, again, back out).
void swap_frame(std::byte * arena, const stream::LandPart & p, const stream::LandedDelta::Frame & f, std::byte * bytes) {
    swap_elements(dtype_size(p.dtype), arena + p.offset, reinterpret_cast<const uint32_t *>(bytes + f.idx_at), f.n, bytes + f.val_at);
}

}  // namespace

int64_t Worker::apply_landed_delta(stream::LandedDelta d, std::vector<stream::LandPart> parts) {
    FD_CHECK(alloc_->resident(Tag::weight) && !device_mem_, "apply_landed_delta without resident host weights");
    forget_weight_delta();
    delta_undo_.landed       = std::move(d);
    delta_undo_.landed_parts = std::move(parts);
    const auto & fs = delta_undo_.landed.frames;
    std::byte * const arena = alloc_->data(Tag::weight);
    try {
        for (size_t i = 0; i < fs.size(); ++i) {
            if (i == fs.size() / 2 && i > 0 && test_fail_here(wcfg_.rank)) {
                if (test_exit_here()) { std::_Exit(3); }
                fail(Errc::internal, "rank {}: TEST ONLY (FD_TEST_DELTA_FAIL_RANK): failing half way through a weight delta", wcfg_.rank);
            }
            swap_frame(arena, delta_undo_.landed_parts[static_cast<size_t>(fs[i].part)], fs[i], delta_undo_.landed.bytes);
            delta_undo_.landed_done = i + 1;
        }
    } catch (...) {
        undo_after_failed_delta(*this, wcfg_.rank);
        throw;
    }
    bind();  // the f32 copies of norms and biases follow the new bytes
    return delta_undo_.landed.n_values();
}

int64_t Worker::apply_rank_delta(weights::RankDelta && d) {
    FD_CHECK(alloc_->resident(Tag::weight), "apply_rank_delta while the weights are released");
    delta_undo_ = {};
    if (d.rank != wcfg_.rank || d.tp != wcfg_.tp_size || d.ep != std::max(1, wcfg_.ep_size)) {
        fail(Errc::invalid_checkpoint, "rank {}: the delta was split for rank {} of tp {} (ep {}), this rank is {} of {} (ep {}); nothing "
             "was applied", wcfg_.rank, d.rank, d.tp, d.ep, wcfg_.rank, wcfg_.tp_size, wcfg_.ep_size);
    }
    // Check everything before writing anything.
    std::vector<const InferenceTensor *> target;
    for (const auto & rt : d.tensors) {
        const InferenceTensor * t = layout_.find(rt.name);
        if (!t || t->dtype != rt.dtype || t->shape != rt.shape) {
            fail(Errc::invalid_checkpoint, "rank {}: delta tensor '{}' ({} {}) does not match the loaded weights ({}); nothing was applied",
                 wcfg_.rank, rt.name, dtype_name(rt.dtype), shape_text(rt.shape),
                 t ? fmt::format("{} {}", dtype_name(t->dtype), shape_text(t->shape)) : std::string("no such tensor"));
        }
        int64_t numel = 1;
        for (const int64_t x : t->shape) { numel *= x; }
        for (int64_t i = 0; i < rt.n_runs(); ++i) {
            const int64_t s = rt.starts[static_cast<size_t>(i)], n = rt.run_len(i);
            if (s < 0 || n < 1 || s > numel - n) {
                fail(Errc::invalid_checkpoint, "rank {}: delta tensor '{}': run {} ([{}, {})) is outside its {} elements; nothing was applied",
                     wcfg_.rank, rt.name, i, s, s + n, numel);
            }
        }
        target.push_back(t);
    }
    delta_undo_.delta = std::move(d);
    auto & ts = delta_undo_.delta.tensors;
    delta_undo_.old.resize(ts.size());
    std::byte * const arena = alloc_->data(Tag::weight);
    std::vector<std::byte> host;  // device memory: the tensor's bytes, downloaded and uploaded back
    int64_t written = 0;
    try {
        for (size_t i = 0; i < ts.size(); ++i) {
            if (i == ts.size() / 2 && i > 0 && test_fail_here(wcfg_.rank)) {
                if (test_exit_here()) { std::_Exit(3); }
                fail(Errc::internal, "rank {}: TEST ONLY (FD_TEST_DELTA_FAIL_RANK): failing half way through a weight delta", wcfg_.rank);
            }
            const InferenceTensor & t = *target[i];
            const int64_t es = dtype_size(t.dtype);
            std::byte * base = arena + t.offset;
            if (device_mem_) {
                host.resize(static_cast<size_t>(t.bytes));
                backend_->download(host.data(), base, t.bytes);
                base = host.data();
            }
            if (ts[i].lens.empty()) {  // one-element runs (a sparse delta): a typed swap, the values become the undo log
                swap_in_place(ts[i], es, base, ts[i].values.data());
            } else {
                auto & old = delta_undo_.old[i];
                old.resize(ts[i].values.size());
                write_runs(ts[i], es, base, ts[i].values.data(), old.data());
            }
            delta_undo_.n_done = i + 1;
            written += ts[i].n_values();
            if (device_mem_) { backend_->upload(arena + t.offset, host.data(), t.bytes); }
        }
    } catch (...) {
        undo_after_failed_delta(*this, wcfg_.rank);
        throw;
    }
    bind();  // the f32 copies of norms and biases follow the new bytes
    return written;
}

std::shared_ptr<const weights::MappedWeightDelta> Worker::read_hf_delta(const std::filesystem::path & file) {
    forget_weight_delta();
    // Over a quarter of this rank's weight bytes (dense tensors, near a full update): mapped, not
    // kept twice. A missing file: its error, naming it.
    return weights::read_weight_delta_into(file, delta_file_, weight_bytes() / 4);
}

void Worker::forget_weight_delta() {
    std::vector<weights::DeltaPiece> keep = std::move(delta_undo_.pieces);  // its capacity, for the next plan
    delta_undo_        = {};
    delta_undo_.pieces = std::move(keep);
}

int64_t Worker::apply_hf_delta(std::shared_ptr<const weights::MappedWeightDelta> d) {
    FD_CHECK(alloc_->resident(Tag::weight), "apply_hf_delta while the weights are released");
    forget_weight_delta();
    // Checks every part; nothing written yet. The last plan's storage is reused.
    weights::DeltaPlan plan = weights::plan_delta_pieces(*d, layout_, std::move(delta_undo_.pieces));
    if (plan.old_bytes > delta_old_bytes_) {  // grown once, then reused: its pages stay faulted in across updates
        delta_old_       = std::unique_ptr<std::byte[]>(new std::byte[static_cast<size_t>(plan.old_bytes)]);
        delta_old_bytes_ = plan.old_bytes;
    }
    delta_undo_.hf     = std::move(d);
    delta_undo_.pieces = std::move(plan.pieces);
    const auto & ps = delta_undo_.pieces;
    const weights::MappedWeightDelta & md = *delta_undo_.hf;
    std::byte * const arena = alloc_->data(Tag::weight);
    std::byte * const old   = delta_old_.get();
    std::vector<std::byte> host;  // device memory: the tensor's bytes, downloaded and uploaded back
    size_t n_tensors = 0;         // inference tensors touched (the test hook fails half way through them)
    for (size_t i = 0; i < ps.size(); ++i) { n_tensors += (i == 0 || ps[i].tensor != ps[i - 1].tensor); }
    try {
        size_t group = 0;
        for (size_t i = 0; i < ps.size(); ++group) {  // one inference tensor's pieces at a time
            const InferenceTensor & t = layout_.tensors[static_cast<size_t>(ps[i].tensor)];
            if (group == n_tensors / 2 && group > 0 && test_fail_here(wcfg_.rank)) {
                if (test_exit_here()) { std::_Exit(3); }
                fail(Errc::internal, "rank {}: TEST ONLY (FD_TEST_DELTA_FAIL_RANK): failing half way through a weight delta", wcfg_.rank);
            }
            std::byte * base = arena + t.offset;
            if (device_mem_) {
                host.resize(static_cast<size_t>(t.bytes));
                backend_->download(host.data(), base, t.bytes);
                base = host.data();
            }
            size_t j = i;
            // The piece kAhead pieces on is prefetched (a column part's rows hold a few elements each).
            constexpr size_t kAhead = 4;
            auto same_tensor = [&](size_t a) { return a < ps.size() && ps[a].tensor == ps[i].tensor; };
            for (size_t a = i; a < i + kAhead && same_tensor(a); ++a) { weights::prefetch_piece(ps[a], md, t, base); }
            for (; same_tensor(j); ++j) {
                if (same_tensor(j + kAhead)) { weights::prefetch_piece(ps[j + kAhead], md, t, base); }
                weights::write_piece(ps[j], md, t, base, old);  // checks its indices first: throws with nothing of it written
                if (!device_mem_) { delta_undo_.pieces_done = j + 1; }
            }
            if (device_mem_) {
                backend_->upload(arena + t.offset, host.data(), t.bytes);
                delta_undo_.pieces_done = j;
            }
            i = j;
        }
    } catch (...) {
        undo_after_failed_delta(*this, wcfg_.rank);
        throw;
    }
    bind();  // the f32 copies of norms and biases follow the new bytes
    return plan.n_values;
}

void Worker::undo_weight_delta() {
    if (!delta_undo_.landed.frames.empty()) {  // a delta landing's frames: swapped back, newest first
        std::byte * const arena = alloc_->data(Tag::weight);
        const auto & fs = delta_undo_.landed.frames;
        for (size_t i = delta_undo_.landed_done; i-- > 0;) {
            swap_frame(arena, delta_undo_.landed_parts[static_cast<size_t>(fs[i].part)], fs[i], delta_undo_.landed.bytes);
        }
        const bool wrote = delta_undo_.landed_done > 0;
        forget_weight_delta();
        if (wrote) { bind(); }
        return;
    }
    if (delta_undo_.hf) {  // apply_hf_delta's pieces, newest first
        std::byte * const arena = alloc_->data(Tag::weight);
        std::vector<std::byte> host;
        const auto & ps = delta_undo_.pieces;
        for (size_t i = delta_undo_.pieces_done; i > 0;) {
            const int32_t ti = ps[i - 1].tensor;
            const InferenceTensor & t = layout_.tensors[static_cast<size_t>(ti)];
            std::byte * base = arena + t.offset;
            if (device_mem_) {
                host.resize(static_cast<size_t>(t.bytes));
                backend_->download(host.data(), base, t.bytes);
                base = host.data();
            }
            for (; i > 0 && ps[i - 1].tensor == ti; --i) { weights::restore_piece(ps[i - 1], *delta_undo_.hf, t, base, delta_old_.get()); }
            if (device_mem_) { backend_->upload(arena + t.offset, host.data(), t.bytes); }
        }
        const bool wrote = delta_undo_.pieces_done > 0;
        delta_undo_ = {};
        if (wrote) { bind(); }
        return;
    }
    if (delta_undo_.n_done == 0) {
        delta_undo_ = {};
        return;
    }
    std::byte * const arena = alloc_->data(Tag::weight);
    std::vector<std::byte> host;
    auto & ts = delta_undo_.delta.tensors;
    // Newest first (runs never overlap, so any order would do).
    for (size_t i = delta_undo_.n_done; i-- > 0;) {
        const InferenceTensor * t = layout_.find(ts[i].name);
        FD_CHECK(t != nullptr, "undo of a delta tensor the layout lost");
        std::byte * base = arena + t->offset;
        if (device_mem_) {
            host.resize(static_cast<size_t>(t->bytes));
            backend_->download(host.data(), base, t->bytes);
            base = host.data();
        }
        if (ts[i].lens.empty()) {
            swap_in_place(ts[i], dtype_size(t->dtype), base, ts[i].values.data());  // the old values back (the new ones into values)
        } else {
            write_runs(ts[i], dtype_size(t->dtype), base, delta_undo_.old[i].data(), nullptr);
        }
        if (device_mem_) { backend_->upload(arena + t->offset, host.data(), t->bytes); }
    }
    delta_undo_ = {};
    bind();
}

}  // namespace fd::model
