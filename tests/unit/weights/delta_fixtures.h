// Fixtures of the delta-split unit tests (test_rank_share.cpp, test_delta_pieces.cpp): a rank's
// weight part, an f32 inference tensor of parts, and a delta whose values are known by index.
#pragma once

#include "fd/weights/rank_delta.h"

#include <cstring>
#include <string>
#include <vector>

namespace fd::test {

/// Part of a rank's tensor taken from HF tensor `hf` [hf_shape]: `rows` rows from row0 along
/// `dim` (0: rows, 1: columns), placed at src0 of the rank's tensor; values of dtype `dt`.
inline model::WeightPart part(const std::string & hf, std::vector<int64_t> hf_shape, int dim, int64_t row0, int64_t rows, int64_t src0,
                              DType dt = DType::f32) {
    model::WeightPart p;
    p.hf_name  = hf;
    p.hf_shape = std::move(hf_shape);
    p.dim      = dim;
    p.row0     = row0;
    p.rows     = rows;
    p.src0     = src0;
    p.dtype    = dt;
    return p;
}

/// An f32 inference tensor `name` [shape] made of `parts` (bytes = 4 * numel).
inline model::InferenceTensor tensor(const std::string & name, std::vector<int64_t> shape, std::vector<model::WeightPart> parts) {
    model::InferenceTensor t;
    t.name  = name;
    t.shape = std::move(shape);
    t.dtype = DType::f32;
    t.parts = std::move(parts);
    int64_t n = 1;
    for (const int64_t d : t.shape) { n *= d; }
    t.bytes = n * 4;
    return t;
}

/// A sparse (or, with dense, every element's) delta of HF tensor `name` [shape] at flat indices
/// `idx`; value k is base + k (F32) or, F16, 1 + k/1024 (exact in f32).
inline weights::DeltaTensor delta(const std::string & name, std::vector<int64_t> shape, std::vector<int64_t> idx, float base,
                                  bool dense = false, DType dt = DType::f32) {
    weights::DeltaTensor t;
    t.name    = name;
    t.dtype   = dt;
    t.shape   = std::move(shape);
    t.dense   = dense;
    t.indices = dense ? std::vector<int64_t>{} : std::move(idx);
    const int64_t n = dense ? t.numel() : static_cast<int64_t>(t.indices.size());
    t.values.resize(static_cast<size_t>(n * dtype_size(dt)));
    for (int64_t k = 0; k < n; ++k) {
        if (dt == DType::f32) {
            const float v = base + static_cast<float>(k);
            std::memcpy(t.values.data() + 4 * k, &v, 4);
        } else {
            const uint16_t h = static_cast<uint16_t>(0x3C00 + k);
            std::memcpy(t.values.data() + 2 * k, &h, 2);
        }
    }
    return t;
}

}  // namespace fd::test
