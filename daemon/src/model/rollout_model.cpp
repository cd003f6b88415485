// RolloutModel: the rollout's state dict per TP rank and its training-name mapping
// (fd/model/rollout_model.h, docs/weight_sources.md).
#include "fd/file_io.h"
#include "fd/model/rollout_model.h"

#include "fd/status.h"

#include <fcntl.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <cstring>

namespace fd::model {
namespace {

enum class Shard { replicated, rows, cols };

bool ends_with(std::string_view s, std::string_view suffix) {
    return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

/// How an inference tensor is split across ranks (rollout_model.h table).
Shard shard_of(const InferenceTensor & t) {
    if (ends_with(t.name, "self_attn.o_proj.weight") || ends_with(t.name, "mlp.down_proj.weight")) { return Shard::cols; }
    if (t.shape.size() == 1 && t.parts.size() == 1) { return Shard::replicated; }  // norms
    return Shard::rows;  // qkv (+bias), gate_up, embed_tokens, lm_head
}

/// Copy `n` elements stored as `from` in `src` to `dst` as `to` (equal, or `to` = f32).
void convert(DType from, DType to, const std::byte * src, std::byte * dst, int64_t n) {
    if (from == to) {
        std::memcpy(dst, src, static_cast<size_t>(n * dtype_size(from)));
        return;
    }
    FD_CHECK(to == DType::f32, "cannot narrow {} to {}", dtype_name(from), dtype_name(to));
    convert_to_f32(from, src, reinterpret_cast<float *>(dst), n);
}

}  // namespace

int64_t StateTensor::numel() const {
    int64_t n = 1;
    for (int64_t d : shape) { n *= d; }
    return n;
}

RolloutModel::RolloutModel(const std::filesystem::path & model_dir, int tp_size)
    : RolloutModel(load_model_config(model_dir), read_tensor_index(model_dir), tp_size) {}

RolloutModel::RolloutModel(ModelConfig cfg, const TensorIndex & idx, int tp_size) : cfg_(std::move(cfg)), tp_(tp_size) {
    if (tp_ < 1) { fail(Errc::invalid_argument, "tensor parallel size must be >= 1, got {}", tp_); }
    const std::pair<const char *, int64_t> dims[] = {{"num_attention_heads", cfg_.n_heads},
                                                     {"num_key_value_heads", cfg_.n_kv_heads},
                                                     {"intermediate_size", cfg_.intermediate_size},
                                                     {"vocab_size", cfg_.vocab_size}};
    for (const auto & [what, n] : dims) {
        if (n % tp_ != 0) {
            fail(Errc::invalid_argument, "{} = {} is not divisible by the tensor parallel size {}; pick a tp that divides it",
                 what, n, tp_);
        }
    }
    validate_checkpoint(cfg_, idx);
    layout_ = plan_layout(cfg_, idx);
}

void RolloutModel::check_rank(int rank) const {
    if (rank < 0 || rank >= tp_) { fail(Errc::invalid_argument, "rank {} is outside [0, {}) (tp size {})", rank, tp_, tp_); }
}

std::vector<RankTensorSource> RolloutModel::training_slices(int rank) const {
    check_rank(rank);
    std::vector<RankTensorSource> out;
    out.reserve(layout_.tensors.size());
    for (const InferenceTensor & t : layout_.tensors) {
        RankTensorSource s;
        s.tensor = {t.name, t.shape, t.dtype};
        switch (shard_of(t)) {
            case Shard::replicated:
                s.slices.push_back({t.parts.front().hf_name, 0, 0, t.shape[0], 0});
                break;
            case Shard::cols: {
                const int64_t n = t.shape[1] / tp_;
                s.tensor.shape[1] = n;
                s.slices.push_back({t.parts.front().hf_name, 1, rank * n, (rank + 1) * n, 0});
                break;
            }
            case Shard::rows: {
                int64_t row = 0;
                for (const WeightPart & p : t.parts) {
                    const int64_t n = p.rows / tp_;
                    s.slices.push_back({p.hf_name, 0, rank * n, (rank + 1) * n, row});
                    row += n;
                }
                s.tensor.shape[0] = row;
                break;
            }
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

std::map<std::string, std::vector<std::string>> RolloutModel::name_mappings_to_training() const {
    std::map<std::string, std::vector<std::string>> m;
    for (const InferenceTensor & t : layout_.tensors) {
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
        if (!fits || (st.dtype != t.dtype && st.dtype != DType::f32)) {
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
        // A column range: read the whole tensor, then take [begin, end) of every row.
        std::vector<std::byte> raw(static_cast<size_t>(t.size_bytes));
        pread_exact(f.get(), raw.data(), t.size_bytes, t.offset_bytes, t.file, what);
        const int64_t n = sl.end - sl.begin;
        for (int64_t r = 0; r < hf_rows; ++r) {
            convert(t.dtype, st.dtype, raw.data() + (r * hf_cols + sl.begin) * es, out + r * n * des, n);
        }
    }
}

}  // namespace fd::model
