// One rank's part of a delta, planned and written straight from the delta file's bytes
// (fd/weights/delta_pieces.h). The index arithmetic is weights::split_delta's (rank_delta.cpp):
// a row part shifts every index by (row0 - src0) × cols; a column part maps HF row r's window
// [r × hf_cols + src0, + cols) onto shard row r.
#include "fd/weights/delta_pieces.h"

#include "fd/checkpoint/safetensors.h"
#include "fd/status.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <string>

namespace fd::weights {

namespace {

std::string shape_text(const std::vector<int64_t> & s) {
    std::string out = "[";
    for (size_t i = 0; i < s.size(); ++i) { out += (i ? ", " : "") + std::to_string(s[i]); }
    return out + "]";
}

/// The first position k in [from, v.n) whose index is >= x (indices sorted; a file that is not
/// gives some position, and write_piece's check refuses the piece). Galloping from `from`: a
/// column part's rows ascend, so each search costs O(log of the distance to the answer).
int64_t lower_bound(const DeltaView & v, int64_t from, int64_t x) {
    int64_t lo = from, hi = from, step = 1;
    while (hi < v.n && v.index(hi) < x) {  // every position < lo holds an index < x
        lo = hi + 1;
        hi += step;
        step *= 2;
    }
    hi = std::min(hi, v.n);  // position hi (when < n) holds an index >= x
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (v.index(mid) < x) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    return lo;
}

int64_t numel_of(const std::vector<int64_t> & shape) {
    int64_t n = 1;
    for (const int64_t d : shape) { n *= d; }
    return n;
}

/// Elements ahead of the one being written whose shard line is prefetched (a 1 % delta's 0.5 M
/// scattered f32 writes into 200 MB, alone on the PVM guest: 16 ahead 4.5 ms, 64 ahead 2.9 ms).
constexpr int64_t kPrefetchAhead = 64;

/// Elements at the piece's indices (+ shift) take its values; the old ones go to `old`. Same
/// dtype on both sides; Index is the file's index type.
template <class Index, class Elem>
void swap_sparse(const DeltaView & v, const DeltaPiece & p, std::byte * shard, std::byte * old) {
    auto * w = reinterpret_cast<Elem *>(shard);
    auto * o = reinterpret_cast<Elem *>(old + p.old_at);
    const std::byte * ip = v.indices + p.k0 * static_cast<int64_t>(sizeof(Index));
    const std::byte * vp = v.values + p.k0 * static_cast<int64_t>(sizeof(Elem));
    const int64_t n = p.n();
    for (int64_t k = 0; k < n; ++k) {
        if (k + kPrefetchAhead < n) {  // the shard's lines are the misses: ask for them early
            Index f;
            std::memcpy(&f, ip + (k + kPrefetchAhead) * static_cast<int64_t>(sizeof(Index)), sizeof(Index));
            __builtin_prefetch(w + static_cast<int64_t>(f) + p.shift, 1);
        }
        Index i;
        Elem  x;
        std::memcpy(&i, ip + k * static_cast<int64_t>(sizeof(Index)), sizeof(Index));
        std::memcpy(&x, vp + k * static_cast<int64_t>(sizeof(Elem)), sizeof(Elem));
        Elem & dst = w[static_cast<int64_t>(i) + p.shift];
        o[k] = dst;
        dst  = x;
    }
}

template <class Index, class Elem>
void unswap_sparse(const DeltaView & v, const DeltaPiece & p, std::byte * shard, const std::byte * old) {
    auto * w = reinterpret_cast<Elem *>(shard);
    const auto * o = reinterpret_cast<const Elem *>(old + p.old_at);
    const std::byte * ip = v.indices + p.k0 * static_cast<int64_t>(sizeof(Index));
    for (int64_t k = 0; k < p.n(); ++k) {
        Index i;
        std::memcpy(&i, ip + k * static_cast<int64_t>(sizeof(Index)), sizeof(Index));
        w[static_cast<int64_t>(i) + p.shift] = o[k];
    }
}

template <class Elem>
void swap_sparse_by_index(const DeltaView & v, const DeltaPiece & p, std::byte * shard, std::byte * old) {
    if (v.index_bytes == 4) {
        swap_sparse<int32_t, Elem>(v, p, shard, old);
    } else {
        swap_sparse<int64_t, Elem>(v, p, shard, old);
    }
}

template <class Elem>
void unswap_sparse_by_index(const DeltaView & v, const DeltaPiece & p, std::byte * shard, const std::byte * old) {
    if (v.index_bytes == 4) {
        unswap_sparse<int32_t, Elem>(v, p, shard, old);
    } else {
        unswap_sparse<int64_t, Elem>(v, p, shard, old);
    }
}

}  // namespace

DeltaPlan plan_delta_pieces(const MappedWeightDelta & d, const model::WeightLayout & layout, std::vector<DeltaPiece> && storage) {
    std::map<std::string, int32_t> by_name;
    for (size_t i = 0; i < d.tensors.size(); ++i) { by_name[d.tensors[i].name] = static_cast<int32_t>(i); }
    DeltaPlan plan;
    plan.pieces = std::move(storage);
    plan.pieces.clear();
    size_t most = 0;  // pieces at most (a column part: one per row), reserved at once: no regrowth
    for (const model::InferenceTensor & t : layout.tensors) {
        for (const model::WeightPart & part : t.parts) {
            if (by_name.count(part.hf_name)) { most += part.dim == 0 ? 1 : static_cast<size_t>(std::max<int64_t>(part.rows, 0)); }
        }
    }
    plan.pieces.reserve(most);
    for (size_t ti = 0; ti < layout.tensors.size(); ++ti) {
        const model::InferenceTensor & t = layout.tensors[ti];
        const int64_t cols = t.shape.size() == 2 ? t.shape[1] : 1, es = model::dtype_size(t.dtype), numel = numel_of(t.shape);
        for (const model::WeightPart & part : t.parts) {
            const auto it = by_name.find(part.hf_name);
            if (it == by_name.end()) { continue; }
            const DeltaView & v = d.tensors[static_cast<size_t>(it->second)];
            if (part.hf_shape != v.shape || (t.dtype != v.dtype && t.dtype != fd::DType::f32)) {
                fail(Errc::invalid_checkpoint, "delta tensor '{}' ({} {}) does not match the loaded weights ({} {} in '{}'); nothing was "
                     "applied", v.name, model::dtype_name(v.dtype), shape_text(v.shape), model::dtype_name(t.dtype),
                     shape_text(part.hf_shape), t.name);
            }
            int64_t from = 0;  // a column part's rows ascend: each search starts where the previous piece ended
            auto add = [&](int64_t lo, int64_t hi, int64_t shift) {
                if (lo + shift < 0 || hi + shift > numel) {
                    fail(Errc::invalid_checkpoint, "delta tensor '{}': HF elements [{}, {}) land outside '{}' ({} elements); nothing was "
                         "applied", v.name, lo, hi, t.name, numel);
                }
                DeltaPiece p{.tensor = static_cast<int32_t>(ti), .src = it->second, .dense = v.dense, .lo = lo, .hi = hi, .shift = shift};
                if (v.dense) {
                    p.k0 = lo;
                    p.k1 = hi;
                } else {
                    p.k0 = lower_bound(v, from, lo);
                    p.k1 = lower_bound(v, p.k0, hi);
                    from = p.k1;
                }
                if (p.n() <= 0) { return; }
                p.old_at = (plan.old_bytes + 7) / 8 * 8;  // each piece's old values aligned for their element type
                plan.old_bytes = p.old_at;
                plan.old_bytes += p.n() * es;
                plan.n_values += p.n();
                plan.pieces.push_back(p);
            };
            if (part.dim == 0) {  // HF rows [src0, src0 + rows) → shard rows [row0, row0 + rows): one shift
                add(part.src0 * cols, (part.src0 + part.rows) * cols, (part.row0 - part.src0) * cols);
                continue;
            }
            // HF columns [src0, src0 + cols) of every row r → shard row r (fill_weights' add_cols)
            const int64_t hf_cols = part.hf_shape.size() == 2 ? part.hf_shape[1] : 1;
            for (int64_t r = 0; r < part.rows; ++r) {
                const int64_t lo = r * hf_cols + part.src0;
                add(lo, lo + cols, r * cols - lo);
            }
        }
    }
    return plan;
}

void prefetch_piece(const DeltaPiece & p, const MappedWeightDelta & d, const model::InferenceTensor & t, std::byte * shard) {
    if (p.dense) { return; }
    const DeltaView & v = d.tensors[static_cast<size_t>(p.src)];
    const int64_t es = model::dtype_size(t.dtype), k1 = std::min(p.k1, p.k0 + kPrefetchAhead);
    for (int64_t k = p.k0; k < k1; ++k) {
        const int64_t i = v.index(k) + p.shift;
        if (i >= p.lo + p.shift && i < p.hi + p.shift) { __builtin_prefetch(shard + i * es, 1); }  // unchecked indices: only inside the piece
    }
}

void write_piece(const DeltaPiece & p, const MappedWeightDelta & d, const model::InferenceTensor & t, std::byte * shard, std::byte * old) {
    const DeltaView & v = d.tensors[static_cast<size_t>(p.src)];
    const int64_t es = model::dtype_size(t.dtype), in_es = model::dtype_size(v.dtype);
    if (p.dense) {  // HF elements [k0, k1): one run
        std::byte * dst = shard + (p.k0 + p.shift) * es;
        std::memcpy(old + p.old_at, dst, static_cast<size_t>(p.n() * es));
        if (v.dtype == t.dtype) {
            std::memcpy(dst, v.values + p.k0 * in_es, static_cast<size_t>(p.n() * es));
        } else {  // F16 / BF16 widened to the f32 shard, as the loader widens
            model::convert_to_f32(v.dtype, v.values + p.k0 * in_es, reinterpret_cast<float *>(dst), p.n());
        }
        return;
    }
    int64_t prev = p.lo - 1;  // checked before a byte is written: sorted, unique, inside the piece's range
    for (int64_t k = p.k0; k < p.k1; ++k) {
        const int64_t i = v.index(k);
        if (i <= prev || i >= p.hi) {
            fail(Errc::invalid_checkpoint, "delta tensor '{}': index {} at position {} is out of order or outside [{}, {}) (the rows of '{}' "
                 "it was planned for)", v.name, i, k, p.lo, p.hi, t.name);
        }
        prev = i;
    }
    if (v.dtype == t.dtype) {
        if (es == 4) {
            swap_sparse_by_index<uint32_t>(v, p, shard, old);
        } else {
            swap_sparse_by_index<uint16_t>(v, p, shard, old);
        }
        return;
    }
    auto * w = reinterpret_cast<float *>(shard);  // widened element by element (F16 / BF16 norms: small)
    auto * o = reinterpret_cast<float *>(old + p.old_at);
    for (int64_t k = p.k0; k < p.k1; ++k) {
        float x;
        model::convert_to_f32(v.dtype, v.values + k * in_es, &x, 1);
        float & dst = w[v.index(k) + p.shift];
        o[k - p.k0] = dst;
        dst         = x;
    }
}

void restore_piece(const DeltaPiece & p, const MappedWeightDelta & d, const model::InferenceTensor & t, std::byte * shard,
                   const std::byte * old) {
    const DeltaView & v = d.tensors[static_cast<size_t>(p.src)];
    const int64_t es = model::dtype_size(t.dtype);
    if (p.dense) {
        std::memcpy(shard + (p.k0 + p.shift) * es, old + p.old_at, static_cast<size_t>(p.n() * es));
        return;
    }
    if (es == 4) {
        unswap_sparse_by_index<uint32_t>(v, p, shard, old);
    } else {
        unswap_sparse_by_index<uint16_t>(v, p, shard, old);
    }
}

}  // namespace fd::weights
