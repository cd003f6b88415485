// RolloutModel: the rollout's state dict per TP rank and its training-name mapping
// (fd/publish/rollout_model.h, docs/weight_sources.md).
#include "fd/file_io.h"
#include "fd/publish/rollout_model.h"

#include "fd/status.h"

#include <fcntl.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

namespace fd::publish {

using namespace fd::model;

namespace {

/// Copy `n` elements stored as `from` in `src` to `dst` as `to` (equal, or `to` = f32).
void convert(fd::DType from, fd::DType to, const std::byte * src, std::byte * dst, int64_t n) {
    if (from == to) {
        std::memcpy(dst, src, static_cast<size_t>(n * dtype_size(from)));
        return;
    }
    FD_CHECK(to == fd::DType::f32, "cannot narrow {} to {}", dtype_name(from), dtype_name(to));
    convert_to_f32(from, src, reinterpret_cast<float *>(dst), n);
}

}  // namespace

int64_t StateTensor::numel() const {
    int64_t n = 1;
    for (int64_t d : shape) { n *= d; }
    return n;
}

RolloutModel::RolloutModel(const std::filesystem::path & model_dir, int tp_size, bool expert_parallel)
    : RolloutModel(load_model_config(model_dir), read_tensor_index(model_dir), tp_size, expert_parallel) {}

RolloutModel::RolloutModel(ModelConfig cfg, const TensorIndex & given, int tp_size, bool expert_parallel)
    : cfg_(std::move(cfg)), tp_(tp_size), ep_(expert_parallel ? std::max(1, tp_size) : 1) {
    if (expert_parallel && !cfg_.moe.enabled()) {
        fail(Errc::invalid_argument, "expert parallel needs a mixture-of-experts model; {} is dense (no num_experts)",
             cfg_.architecture);
    }
    check_tp_divides(cfg_, tp_, ep_);
    TensorIndex renamed;  // transformers v5 Mixtral names: training_slices name the v4 ones
    const TensorIndex & idx = with_v4_names(cfg_, given, renamed);
    validate_checkpoint(cfg_, idx);
    layout_ = plan_layout(cfg_, idx);
    // The loader's own plan for every rank (layout.h: the one home of the sharding).
    for (int r = 0; r < tp_; ++r) { rank_layouts_.push_back(plan_layout(cfg_, idx, {r, tp_, ep_})); }
}

std::pair<int32_t, int32_t> RolloutModel::rank_experts(int rank) const {
    check_rank(rank);
    return model::rank_experts(cfg_.moe.enabled() ? cfg_.moe.n_experts : 0, {rank, tp_, ep_});
}

const WeightLayout & RolloutModel::rank_layout(int rank) const {
    check_rank(rank);
    return rank_layouts_[static_cast<size_t>(rank)];
}

void RolloutModel::check_rank(int rank) const {
    if (rank < 0 || rank >= tp_) { fail(Errc::invalid_argument, "rank {} is outside [0, {}) (tp size {})", rank, tp_, tp_); }
}

std::vector<RankTensorSource> RolloutModel::training_slices(int rank) const {
    std::vector<RankTensorSource> out;
    for (const InferenceTensor & t : rank_layout(rank).tensors) {
        RankTensorSource s;
        s.tensor = {t.name, t.shape, t.dtype};
        const int64_t cols = t.shape.size() == 2 ? t.shape[1] : 1;
        for (const WeightPart & p : t.parts) {
            s.slices.push_back({p.hf_name, p.dim, p.src0, p.src0 + (p.dim == 0 ? p.rows : cols), p.row0});
        }
        out.push_back(std::move(s));
    }
    return out;
}

std::vector<StateTensor> RolloutModel::state_dict(int rank) const {
    std::vector<StateTensor> out;
    for (auto & s : training_slices(rank)) { out.push_back(std::move(s.tensor)); }
    return out;
}

std::map<std::string, std::vector<std::string>> RolloutModel::name_mappings_to_training(int rank) const {
    if (rank != -1) { check_rank(rank); }
    std::map<std::string, std::vector<std::string>> m;
    for (const InferenceTensor & t : (rank < 0 ? layout_ : rank_layouts_[static_cast<size_t>(rank)]).tensors) {
        auto & v = m[t.name];
        for (const WeightPart & p : t.parts) { v.push_back(p.hf_name); }
    }
    return m;
}

void RolloutModel::gather(const RankTensorSource & src, const TensorIndex & idx, std::byte * dst) {
    const StateTensor & st   = src.tensor;
    const int64_t       cols = st.shape.size() == 2 ? st.shape[1] : 1;
    const int64_t       des  = dtype_size(st.dtype);
    for (const TrainingSlice & sl : src.slices) {
        auto it = idx.tensors.find(sl.hf_name);
        if (it == idx.tensors.end()) {
            fail(Errc::invalid_checkpoint, "{}: checkpoint is missing tensor '{}' (part of '{}')", idx.source.string(),
                 sl.hf_name, st.name);
        }
        const TensorInfo & t  = it->second;
        const int64_t      es = dtype_size(t.dtype);
        const int64_t hf_rows = t.shape.empty() ? 1 : t.shape[0];
        const int64_t hf_cols = t.shape.size() == 2 ? t.shape[1] : 1;
        const bool fits = t.shape.size() == st.shape.size() &&
                          (sl.dim == 0 ? hf_cols == cols && sl.end <= hf_rows : hf_rows == st.shape[0] && sl.end <= hf_cols);
        if (!fits || (st.dtype != t.dtype && st.dtype != fd::DType::f32)) {
            fail(Errc::invalid_checkpoint, "{}: tensor '{}' has shape [{}] {}, which cannot fill '{}' [{}] {}", t.file.string(),
                 t.name, fmt::join(t.shape, ", "), dtype_name(t.dtype), st.name, fmt::join(st.shape, ", "), dtype_name(st.dtype));
        }
        const UniqueFd f = open_read(t.file, Errc::invalid_checkpoint);
        const std::string what = "tensor '" + t.name + "'";
        std::byte * out = dst + sl.dst_row0 * cols * des;
        if (sl.dim == 0) {  // a row range: one contiguous read
            const int64_t n = (sl.end - sl.begin) * hf_cols;
            if (t.dtype == st.dtype) {
                pread_exact(f.get(), out, n * es, t.offset_bytes + sl.begin * hf_cols * es, t.file, what);
            } else {
                std::vector<std::byte> raw(static_cast<size_t>(n * es));
                pread_exact(f.get(), raw.data(), n * es, t.offset_bytes + sl.begin * hf_cols * es, t.file, what);
                convert(t.dtype, st.dtype, raw.data(), out, n);
            }
            continue;
        }
        // A column range: [begin, end) of every row, one read per row.
        const int64_t n = sl.end - sl.begin;
        std::vector<std::byte> raw(static_cast<size_t>(n * es));
        for (int64_t r = 0; r < hf_rows; ++r) {
            pread_exact(f.get(), raw.data(), n * es, t.offset_bytes + (r * hf_cols + sl.begin) * es, t.file, what);
            convert(t.dtype, st.dtype, raw.data(), out + r * n * des, n);
        }
    }
}

}  // namespace fd::publish
