// Worker::apply_weight_delta / undo_weight_delta (fd/model/worker.h): a sparse weight update
// written in place into this rank's shard, with an undo log so that the executor can put every
// rank back when any one fails (the delta stream's all-or-nothing commit).
#include "fd/model/worker.h"

#include "fd/log.h"
#include "fd/status.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>

namespace fd::model {

using memory::Tag;

namespace {

struct Target {
    const InferenceTensor * t = nullptr;
    const WeightPart *      p = nullptr;
};

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

}  // namespace

int64_t Worker::apply_weight_delta(const weights::WeightDelta & d) {
    FD_CHECK(alloc_->resident(Tag::weight), "apply_weight_delta while the weights are released");
    delta_undo_.clear();
    std::map<std::string, std::vector<Target>> by_name;
    for (const InferenceTensor & t : layout_.tensors) {
        for (const WeightPart & p : t.parts) { by_name[p.hf_name].push_back({&t, &p}); }
    }
    // Check everything before writing anything.
    for (const auto & dt : d.tensors) {
        auto it = by_name.find(dt.name);
        if (it == by_name.end()) { continue; }  // not read by this rank's layout (a tied lm_head, another rank's experts)
        for (const Target & g : it->second) {
            const bool widen = g.t->dtype != dt.dtype;
            if (g.p->hf_shape != dt.shape || (widen && g.t->dtype != fd::DType::f32)) {
                fail(Errc::invalid_checkpoint, "rank {}: delta tensor '{}' ({} {}) does not match the loaded weights ({} {} in '{}'); "
                     "nothing was applied", wcfg_.rank, dt.name, dtype_name(dt.dtype), shape_text(dt.shape), dtype_name(g.t->dtype),
                     shape_text(g.p->hf_shape), g.t->name);
            }
        }
    }
    std::byte * const arena = alloc_->data(Tag::weight);
    std::vector<std::byte> host;  // device memory: the tensor's bytes, downloaded and uploaded back
    int64_t written = 0;
    size_t  n_done  = 0;
    try {
        for (const auto & dt : d.tensors) {
            if (n_done++ == d.tensors.size() / 2 && test_fail_here(wcfg_.rank)) {
                if (test_exit_here()) { std::_Exit(3); }
                fail(Errc::internal, "rank {}: TEST ONLY (FD_TEST_DELTA_FAIL_RANK): failing half way through a weight delta", wcfg_.rank);
            }
            auto it = by_name.find(dt.name);
            if (it == by_name.end()) { continue; }
            const int64_t in_es = dtype_size(dt.dtype);
            const int64_t n     = dt.dense ? dt.numel() : static_cast<int64_t>(dt.indices.size());
            for (const Target & g : it->second) {
                const InferenceTensor & t = *g.t;
                const WeightPart &      p = *g.p;
                const bool    widen   = t.dtype != dt.dtype;
                const int64_t es      = dtype_size(t.dtype);
                const int64_t cols    = t.shape.size() == 2 ? t.shape[1] : 1;
                const int64_t hf_cols = p.hf_shape.size() == 2 ? p.hf_shape[1] : 1;
                std::byte * base = arena + t.offset;
                if (device_mem_) {
                    host.resize(static_cast<size_t>(t.bytes));
                    backend_->download(host.data(), base, t.bytes);
                    base = host.data();
                }
                // The HF elements this part holds: a row range is one index range (indices are
                // sorted); a column range spans rows p.rows of the HF tensor.
                const int64_t lo_elem = p.dim == 1 ? 0 : p.src0 * cols;
                const int64_t hi_elem = p.dim == 1 ? p.rows * hf_cols : (p.src0 + p.rows) * cols;
                int64_t k0 = 0, k1 = n;
                if (dt.dense) {
                    k0 = std::min(lo_elem, n);
                    k1 = std::min(hi_elem, n);
                } else {
                    k0 = std::lower_bound(dt.indices.begin(), dt.indices.end(), lo_elem) - dt.indices.begin();
                    k1 = std::lower_bound(dt.indices.begin(), dt.indices.end(), hi_elem) - dt.indices.begin();
                }
                DeltaUndo & u = delta_undo_.emplace_back();
                u.offset = t.offset;
                u.elem   = es;
                u.elems.reserve(static_cast<size_t>(k1 - k0));
                u.old.resize(static_cast<size_t>((k1 - k0) * es));
                int64_t n_u = 0;
                for (int64_t k = k0; k < k1; ++k) {
                    const int64_t i = dt.dense ? k : dt.indices[static_cast<size_t>(k)];
                    int64_t e = 0;
                    if (p.dim == 1) {  // a column range of the HF tensor, every row (fill_weights' add_cols)
                        const int64_t r = i / hf_cols, c = i % hf_cols;
                        if (c < p.src0 || c >= p.src0 + cols || r >= p.rows) { continue; }
                        e = r * cols + (c - p.src0);
                    } else {  // a row range, stacked at row0 (q|k|v, gate|up, vocab rows)
                        const int64_t r = i / cols, c = i % cols;
                        if (r < p.src0 || r >= p.src0 + p.rows) { continue; }
                        e = (p.row0 + r - p.src0) * cols + c;
                    }
                    std::byte * at = base + e * es;
                    u.elems.push_back(e);
                    std::memcpy(u.old.data() + n_u * es, at, static_cast<size_t>(es));
                    ++n_u;
                    const std::byte * src = dt.values.data() + k * in_es;
                    if (widen) {
                        float f = 0;
                        convert_to_f32(dt.dtype, src, &f, 1);
                        std::memcpy(at, &f, sizeof f);
                    } else {
                        std::memcpy(at, src, static_cast<size_t>(es));
                    }
                    ++written;
                }
                u.old.resize(static_cast<size_t>(n_u * es));
                if (device_mem_) { backend_->upload(arena + t.offset, host.data(), t.bytes); }
            }
        }
    } catch (...) {
        try {
            undo_weight_delta();
        } catch (const std::exception & e) {
            log::get("model")->error("rank {}: putting the old weights back after a failed delta failed too: {}", wcfg_.rank, e.what());
        }
        throw;
    }
    bind();  // the f32 copies of norms and biases follow the new bytes
    return written;
}

void Worker::undo_weight_delta() {
    if (delta_undo_.empty()) { return; }
    std::byte * const arena = alloc_->data(Tag::weight);
    std::vector<std::byte> host;
    // Newest first: a tensor written through two parts gets its oldest bytes last.
    for (auto u = delta_undo_.rbegin(); u != delta_undo_.rend(); ++u) {
        if (u->elems.empty()) { continue; }
        int64_t span = 0;
        for (const int64_t e : u->elems) { span = std::max(span, (e + 1) * u->elem); }
        std::byte * base = arena + u->offset;
        if (device_mem_) {
            host.resize(static_cast<size_t>(span));
            backend_->download(host.data(), base, span);
            base = host.data();
        }
        for (size_t k = 0; k < u->elems.size(); ++k) {
            std::memcpy(base + u->elems[k] * u->elem, u->old.data() + static_cast<int64_t>(k) * u->elem, static_cast<size_t>(u->elem));
        }
        if (device_mem_) { backend_->upload(arena + u->offset, host.data(), span); }
    }
    delta_undo_.clear();
    bind();
}

}  // namespace fd::model
