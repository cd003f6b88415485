#include "fd/file_io.h"
#include "fd/model/weights.h"
#include "fd/memory/cuda_ipc.h"
#include "fd/progress.h"

#include "fd/log.h"
#include "fd/status.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <algorithm>
#include <set>

namespace fd::model {
namespace {

std::string layer_name(int il, const char * leaf) { return fmt::format("model.layers.{}.{}", il, leaf); }


/// The checkpoint's files, opened once for a fill: never blocking (open_regular refuses FIFOs
/// and devices), and each the very file whose header was indexed (same st_dev/st_ino), so a
/// file swapped after validation is never read.
class OpenFiles {
public:
    int fd(const TensorInfo & t) {
        auto it = fds_.find(t.file);
        if (it != fds_.end()) { return it->second.get(); }
        struct stat st{};
        UniqueFd f = open_regular(t.file, Errc::invalid_checkpoint, &st);
        if ((t.file_dev || t.file_ino) && (static_cast<uint64_t>(st.st_dev) != t.file_dev || static_cast<uint64_t>(st.st_ino) != t.file_ino)) {
            fail(Errc::source_unavailable, "{}: the file was replaced after its header was read; retry", t.file.string());
        }
        return fds_.emplace(t.file, std::move(f)).first->second.get();
    }

private:
    std::map<std::filesystem::path, UniqueFd> fds_;
};

/// `n_rows` ranges of `n_elems` elements of one checkpoint tensor, `src_stride` bytes apart
/// (a column slice; 1 row for a contiguous range), going to consecutive places in the arena.
struct CopyJob {
    const TensorInfo * src = nullptr;
    int                fd  = -1;
    int64_t            src_offset = 0;  ///< bytes into the tensor's data (first row)
    int64_t            n_elems    = 0;  ///< per row
    std::byte *        dst = nullptr;
    bool               widen = false;   ///< convert the stored dtype to f32
    int64_t            n_rows = 1;
    int64_t            src_stride = 0;  ///< bytes between rows in the file
};

constexpr int64_t kChunkBytes = 8 << 20;
/// Reads are split into pieces this small so the finite check scans each while it is in L2.
constexpr int64_t kScanBytes = 256 << 10;
/// A column slice (a rank's columns of o_proj / down_proj) is read a block of rows per call
/// (pread_rows_exact: the other ranks' columns between them read and dropped) when that is at
/// most this much per row; wider gaps read row by row. A syscall costs about as much as copying
/// this many bytes (one pread per row was ~half a tp=2 update's rank time: docs/benchmarks.md).
constexpr int64_t kMaxRowGapBytes = 16 << 10;

/// Index of the first NaN/Inf among `n` values stored as `d` at `p`, or -1.
int64_t find_nonfinite(fd::DType d, const void * p, int64_t n) {
    switch (d) {
        case fd::DType::f32: return kernels::find_nonfinite_f32(static_cast<const float *>(p), n);
        case fd::DType::bf16: return kernels::find_nonfinite_bf16(static_cast<const uint16_t *>(p), n);
        case fd::DType::f16: return kernels::find_nonfinite_f16(static_cast<const uint16_t *>(p), n);
    }
    return -1;
}

[[noreturn]] void fail_nonfinite(const TensorInfo & t, int64_t elem, const void * p) {
    double v = 0;
    if (t.dtype == fd::DType::f32) {
        v = *static_cast<const float *>(p);
    } else {
        float f = 0;
        convert_to_f32(t.dtype, p, &f, 1);
        v = f;
    }
    fail(Errc::invalid_checkpoint, "{}: tensor '{}' holds a non-finite value ({}) at element {}; a checkpoint with NaN or Inf "
                                   "weights is refused and nothing of it applied (a failed update keeps the previous weights serving; a failed "
                                   "wakeup stays asleep)", t.file.string(), t.name, v, elem);
}

/// A tied model that stores an lm_head.weight the embedding does not equal: HF ignores the
/// stored head (the embedding is the head), so do we, but say so (a warning naming it). The
/// two are compared as stored, in kScanBytes pieces (two small buffers, not zeroed: this runs at
/// every load and update, and fresh pages cost more to touch than the compare).
void warn_if_untied_head(const WeightLayout & layout, const TensorIndex & idx, OpenFiles & files) {
    auto head = idx.tensors.find("lm_head.weight");
    auto emb  = idx.tensors.find("model.embed_tokens.weight");
    if (!layout.tied_lm_head || head == idx.tensors.end() || emb == idx.tensors.end()) { return; }
    if (head->second.on_cuda_ipc || emb->second.on_cuda_ipc) { return; }  // not in a file
    const TensorInfo & h = head->second;
    const TensorInfo & e = emb->second;
    bool differs = h.shape != e.shape || h.dtype != e.dtype;
    const size_t piece = static_cast<size_t>(std::min<int64_t>(kScanBytes, h.size_bytes));
    const auto   a = std::make_unique_for_overwrite<std::byte[]>(differs ? 0 : piece);
    const auto   b = std::make_unique_for_overwrite<std::byte[]>(differs ? 0 : piece);
    for (int64_t off = 0; !differs && off < h.size_bytes; off += static_cast<int64_t>(piece)) {
        const int64_t n = std::min<int64_t>(static_cast<int64_t>(piece), h.size_bytes - off);
        pread_exact(files.fd(h), a.get(), n, h.offset_bytes + off, h.file, "tensor 'lm_head.weight'");
        pread_exact(files.fd(e), b.get(), n, e.offset_bytes + off, e.file, "tensor 'model.embed_tokens.weight'");
        differs = std::memcmp(a.get(), b.get(), static_cast<size_t>(n)) != 0;
    }
    if (differs) {
        log::get("model")->warn("{}: the model ties lm_head to the embedding (tie_word_embeddings) but the checkpoint's stored "
                                "'lm_head.weight' differs from 'model.embed_tokens.weight'; it is ignored, as Hugging Face does",
                                h.file.string());
    }
}

/// A column-slice job (rows of j.n_elems, j.src_stride apart in the file) read a block of rows
/// per pread_rows_exact into `out` (j.n_rows x j.n_elems, f32 when j.widen): each block is
/// checked for NaN/Inf while in cache (`check`) and widened, as the row-by-row path does.
void read_column_rows(const CopyJob & j, std::byte * out, bool check, const std::string & what) {
    const int64_t es = dtype_size(j.src->dtype), des = j.widen ? 4 : es, row_bytes = j.n_elems * es;
    const int64_t rows_per = std::clamp<int64_t>(kScanBytes / row_bytes, 1, j.n_rows);
    std::vector<std::byte> gap(static_cast<size_t>(j.src_stride - row_bytes));  // the other ranks' columns
    std::vector<std::byte> raw(j.widen ? static_cast<size_t>(rows_per * row_bytes) : 0);
    for (int64_t row = 0; row < j.n_rows; row += rows_per) {
        const int64_t k = std::min(rows_per, j.n_rows - row);
        std::byte *   p = j.widen ? raw.data() : out + row * j.n_elems * des;
        pread_rows_exact(j.fd, p, k, row_bytes, j.src->offset_bytes + j.src_offset + row * j.src_stride, j.src_stride, gap.data(),
                         j.src->file, what);
        if (check) {
            if (const int64_t bad = find_nonfinite(j.src->dtype, p, k * j.n_elems); bad >= 0) {
                fail_nonfinite(*j.src, (j.src_offset + (row + bad / j.n_elems) * j.src_stride) / es + bad % j.n_elems, p + bad * es);
            }
        }
        if (j.widen) { convert_to_f32(j.src->dtype, p, reinterpret_cast<float *>(out + row * j.n_elems * des), k * j.n_elems); }
        Progress::current().add_done(k * row_bytes);
    }
}

}  // namespace

void fill_weights(const WeightLayout & layout, const TensorIndex & idx, std::byte * base, kernels::ThreadPool * pool,
                  const FillOptions & opt) {
    using Clock = std::chrono::steady_clock;
    const auto deadline = opt.timeout_s > 0 ? Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(opt.timeout_s))
                                            : Clock::time_point::max();
    OpenFiles files;
    std::vector<CopyJob> jobs;
    // Split `n` elements of `src` from element `e0` into chunks going to `dst` in memory dtype `d`.
    auto add = [&](const TensorInfo & src, int64_t e0, int64_t n, std::byte * dst, fd::DType d) {
        const bool    widen = src.dtype != d;
        const int64_t es    = dtype_size(src.dtype), chunk = kChunkBytes / es;
        const int     fd    = src.on_cuda_ipc ? -1 : files.fd(src);
        for (int64_t e = 0; e < n; e += chunk) {
            jobs.push_back({&src, fd, (e0 + e) * es, std::min(chunk, n - e), dst + e * dtype_size(d), widen});
        }
    };
    // Column range [c0, c0 + n) of each of the `rows` rows of `src` (row length src.shape[1]) to
    // consecutive rows of `dst`: jobs of whole rows, about a chunk each, each row one pread.
    auto add_cols = [&](const TensorInfo & src, int64_t rows, int64_t c0, int64_t n, std::byte * dst, fd::DType d) {
        const bool    widen = src.dtype != d;
        const int64_t es = dtype_size(src.dtype), stride = src.shape[1] * es;
        const int64_t per_job = std::max<int64_t>(1, kChunkBytes / (n * es));
        const int     fd = src.on_cuda_ipc ? -1 : files.fd(src);
        for (int64_t r = 0; r < rows; r += per_job) {
            jobs.push_back({&src, fd, r * stride + c0 * es, n, dst + r * n * dtype_size(d), widen, std::min(per_job, rows - r), stride});
        }
    };
    for (const InferenceTensor & t : layout.tensors) {
        std::byte * dst = base + t.offset;
        if (holds_inference_form(t, idx)) {  // a snapshot / ipc record: this rank's tensor as it is
            const TensorInfo & whole = idx.tensors.at(t.name);
            add(whole, 0, whole.numel(), dst, t.dtype);
            continue;
        }
        const int64_t cols = t.shape.size() == 2 ? t.shape[1] : 1;
        for (const WeightPart & p : t.parts) {
            const TensorInfo & src = idx.tensors.at(p.hf_name);
            if (p.dim == 1) {
                add_cols(src, p.rows, p.src0, cols, dst, t.dtype);
            } else {
                add(src, p.src0 * cols, p.rows * cols, dst + p.row0 * cols * dtype_size(t.dtype), t.dtype);
            }
        }
    }
    int64_t total_bytes = 0, max_out = 0;
    for (const CopyJob & j : jobs) {
        total_bytes += j.n_rows * j.n_elems * dtype_size(j.src->dtype);
        max_out = std::max(max_out, j.n_rows * j.n_elems * (j.widen ? 4 : dtype_size(j.src->dtype)));
    }
    // A device destination: each job lands in a host bounce buffer (one per pool thread), then
    // one upload. The check and the widening stay fused into the host-side copy.
    kernels::Backend * const dev = opt.upload_to;
    std::mutex               upload_mu, bounce_mu;
    std::vector<std::byte *> bounce_free;
    std::vector<std::unique_ptr<std::byte[]>> bounce_plain;
    std::vector<void *>      bounce_pinned;
    struct PinnedFree {
        kernels::Backend * be;
        std::vector<void *> * v;
        ~PinnedFree() { if (be) { for (void * p : *v) { be->free_pinned_host(p); } } }
    } pinned_free{dev, &bounce_pinned};
    if (dev && max_out > 0) {
        const int n_buf = pool ? pool->n_threads() : 1;
        for (int i = 0; i < n_buf; ++i) {
            void * p = dev->alloc_pinned_host(max_out);
            if (p) {
                bounce_pinned.push_back(p);
                bounce_free.push_back(static_cast<std::byte *>(p));
            } else {
                bounce_plain.push_back(std::make_unique<std::byte[]>(static_cast<size_t>(max_out)));
                bounce_free.push_back(bounce_plain.back().get());
            }
        }
    }
    // CUDA IPC tensors (the ipc source on a CUDA rank): each allocation opened once; copies go
    // device to device when the destination is the device and no widening is needed.
    memory::CudaIpcOpened ipc_opened;
    std::mutex             ipc_mu;
    const bool             d2d_ok = dev && dev->kind() == kernels::DeviceKind::cuda;
    ProgressPhase progress("load", total_bytes);  // /health `progress` while the copy runs
    std::mutex         mu;
    std::exception_ptr first_error;
    std::atomic<bool>  failed{false};
    // One job: read its range in kScanBytes pieces; each piece is checked for NaN/Inf right
    // after its read, while it is still in cache (the check costs no extra pass over memory).
    auto run = [&](int64_t i) {
        if (failed.load(std::memory_order_relaxed)) { return; }
        const CopyJob & j = jobs[i];
        try {
            if (Clock::now() > deadline) {
                fail(Errc::timeout, "{}: reading the weights took longer than {} s (--control-timeout-s); is the file system "
                                    "hung? nothing was applied", j.src->file.string(), opt.timeout_s);
            }
            const std::string what    = "tensor '" + j.src->name + "'";
            const int64_t     es      = dtype_size(j.src->dtype);
            const std::byte * ipc     = nullptr;  // the CUDA IPC allocation's device address
            if (j.src->on_cuda_ipc) {
                std::lock_guard lk(ipc_mu);
                ipc = static_cast<const std::byte *>(ipc_opened.base(j.src->cuda_ipc_handle.data(), j.src->file.string() + ": " + what));
            }
            if (ipc && d2d_ok && !j.widen) {  // device to device, checked on the device
                const fd::DType st = j.src->dtype;
                for (int64_t row = 0; row < j.n_rows; ++row) {
                    const int64_t src_row = j.src_offset + row * j.src_stride;
                    std::byte *   dst_row = j.dst + row * j.n_elems * es;
                    std::lock_guard lk(upload_mu);
                    memory::cuda_copy(dst_row, ipc + j.src->offset_bytes + src_row, static_cast<uint64_t>(j.n_elems * es), what);
                    if (opt.check_finite) {
                        if (const int64_t bad = dev->find_nonfinite(dst_row, st, j.n_elems); bad >= 0) {
                            std::byte v[4] = {};
                            dev->download(v, dst_row + bad * es, es);
                            fail_nonfinite(*j.src, src_row / es + bad, v);
                        }
                    }
                    Progress::current().add_done(j.n_elems * es);
                }
                return;
            }
            // Unchecked and not widened: one pread for the whole chunk (the path without the check).
            const int64_t     per     = opt.check_finite || j.widen ? kScanBytes / es : j.n_elems;
            std::vector<std::byte> raw(j.widen ? static_cast<size_t>(std::min(per, j.n_elems) * es) : 0);
            const int64_t     des     = j.widen ? 4 : es;  // bytes per element in the arena
            std::byte *       out     = j.dst;             // host memory this job writes
            if (dev) {
                std::lock_guard lk(bounce_mu);
                FD_CHECK(!bounce_free.empty(), "fill_weights: no free bounce buffer");
                out = bounce_free.back();
                bounce_free.pop_back();
            }
            struct Return {
                std::byte * p;
                std::mutex * mu;
                std::vector<std::byte *> * v;
                ~Return() { if (p) { std::lock_guard lk(*mu); v->push_back(p); } }
            } give_back{dev ? out : nullptr, &bounce_mu, &bounce_free};
            const int64_t row_bytes = j.n_elems * es;
            const bool    by_rows   = !ipc && j.n_rows > 1 && j.src_stride >= row_bytes && j.src_stride - row_bytes <= kMaxRowGapBytes;
            if (by_rows) { read_column_rows(j, out, opt.check_finite, what); }
            for (int64_t row = 0; !by_rows && row < j.n_rows; ++row) {
                const int64_t src_row = j.src_offset + row * j.src_stride;
                std::byte *   dst_row = out + row * j.n_elems * des;
                for (int64_t e = 0; e < j.n_elems; e += per) {
                    const int64_t n   = std::min(per, j.n_elems - e);
                    const int64_t off = j.src->offset_bytes + src_row + e * es;
                    std::byte *   p   = j.widen ? raw.data() : dst_row + e * es;
                    if (ipc) {  // a CUDA IPC tensor read to host (a host destination, or widening)
                        std::lock_guard lk(upload_mu);
                        memory::cuda_copy(p, ipc + off, static_cast<uint64_t>(n * es), what);
                    } else {
                        pread_exact(j.fd, p, n * es, off, j.src->file, what);
                    }
                    if (opt.check_finite) {
                        if (const int64_t bad = find_nonfinite(j.src->dtype, p, n); bad >= 0) {
                            fail_nonfinite(*j.src, src_row / es + e + bad, p + bad * es);
                        }
                    }
                    if (j.widen) { convert_to_f32(j.src->dtype, p, reinterpret_cast<float *>(dst_row) + e, n); }
                    Progress::current().add_done(n * es);
                }
            }
            if (dev) {
                std::lock_guard lk(upload_mu);
                dev->upload(j.dst, out, j.n_rows * j.n_elems * des);
            }
        } catch (...) {
            std::lock_guard lk(mu);
            if (!first_error) { first_error = std::current_exception(); }
            failed.store(true, std::memory_order_relaxed);
        }
    };
    if (pool) {
        pool->parallel_for(static_cast<int64_t>(jobs.size()), run);
    } else {
        for (int64_t i = 0; i < static_cast<int64_t>(jobs.size()); ++i) { run(i); }
    }
    if (first_error) { std::rethrow_exception(first_error); }
    warn_if_untied_head(layout, idx, files);
}

ModelWeights bind_weights(const ModelConfig & c, const WeightLayout & layout, const std::byte * base, kernels::Backend * device,
                          kernels::ScratchBuffer * small_store) {
    FD_CHECK(device == nullptr || small_store != nullptr, "bind_weights: device weights need a small_store");
    ModelWeights w;
    std::vector<std::byte> host;  // a small tensor downloaded from the device
    int64_t n_small = 0;
    for (const auto & t : layout.tensors) { n_small += t.shape.size() == 1 ? t.shape[0] : 0; }
    w.small_f32.resize(static_cast<size_t>(n_small));
    int64_t next = 0;
    auto get = [&](const std::string & name) -> const InferenceTensor & {
        const InferenceTensor * t = layout.find(name);
        FD_CHECK(t != nullptr, "inference tensor '{}' is not in the layout", name);
        return *t;
    };
    auto lin = [&](const std::string & name) {
        const InferenceTensor & t = get(name);
        FD_CHECK(t.dtype != fd::DType::f16, "inference tensor '{}' is f16 in memory (the layout widens F16 to f32)", name);
        return LinearWeight{base + t.offset, t.dtype};
    };
    auto vec = [&](const std::string & name) -> const float * {
        const InferenceTensor & t = get(name);
        float * dst = w.small_f32.data() + next;
        const std::byte * src = base + t.offset;
        if (device) {
            host.resize(static_cast<size_t>(t.shape[0] * dtype_size(t.dtype)));
            device->download(host.data(), src, static_cast<int64_t>(host.size()));
            src = host.data();
        }
        convert_to_f32(t.dtype, src, dst, t.shape[0]);
        next += t.shape[0];
        return dst;
    };
    w.embed = lin("model.embed_tokens.weight");
    // The attention half of a block under `pre` ("model.layers.N." / "model.mtp_layers.N.").
    auto attention = [&](LayerWeights & L, const std::string & pre) {
        L.attn_norm = vec(pre + "input_layernorm.weight");
        L.qkv       = lin(pre + "self_attn.qkv_proj.weight");
        L.bqkv      = c.qkv_bias ? vec(pre + "self_attn.qkv_proj.bias") : nullptr;
        L.q_norm    = c.qk_norm ? vec(pre + "self_attn.q_norm.weight") : nullptr;
        L.k_norm    = c.qk_norm ? vec(pre + "self_attn.k_norm.weight") : nullptr;
        L.o         = lin(pre + "self_attn.o_proj.weight");
        L.mlp_norm  = vec(pre + "post_attention_layernorm.weight");
    };
    w.layers.resize(static_cast<size_t>(c.n_layers));
    for (int il = 0; il < c.n_layers; ++il) {
        LayerWeights & L = w.layers[il];
        attention(L, layer_name(il, ""));
        if (!c.is_moe_layer(il)) {
            L.gate_up = lin(layer_name(il, "mlp.gate_up_proj.weight"));
            L.down    = lin(layer_name(il, "mlp.down_proj.weight"));
            continue;
        }
        const MoeConfig & m = c.moe;
        const std::string p = layer_name(il, m.prefix.c_str());
        const std::string fused = c.arch == Arch::mixtral ? "w13" : "gate_up_proj";
        L.moe.router = lin(p + ".gate.weight");
        L.moe.experts.resize(static_cast<size_t>(m.n_experts));  // expert parallel: only this rank's are bound
        const auto [e0, e1] = rank_experts(m.n_experts, layout.tp);
        for (int e = e0; e < e1; ++e) {
            const LinearWeight gu = lin(fmt::format("{}.experts.{}.{}.weight", p, e, fused));
            const LinearWeight dn = lin(fmt::format("{}.experts.{}.{}.weight", p, e, m.down_name));
            L.moe.experts[static_cast<size_t>(e)] = {gu.w, gu.type, dn.w, dn.type};
        }
        if (m.shared_intermediate > 0) {
            L.moe.shared_gate_up = lin(p + ".shared_expert.gate_up_proj.weight");
            L.moe.shared_down    = lin(p + ".shared_expert.down_proj.weight");
            L.moe.shared_gate    = lin(p + ".shared_expert_gate.weight");
        }
    }
    w.final_norm = vec("model.norm.weight");
    w.lm_head    = layout.tied_lm_head ? w.embed : lin("lm_head.weight");
    w.mtp.resize(static_cast<size_t>(c.n_mtp_layers));
    for (int m = 0; m < c.n_mtp_layers; ++m) {
        MtpWeights &      M   = w.mtp[static_cast<size_t>(m)];
        const std::string pre = fmt::format("model.mtp_layers.{}.", m);
        M.token_norm  = vec(pre + "token_layernorm.weight");
        M.hidden_norm = vec(pre + "hidden_layernorm.weight");
        M.input_proj  = lin(pre + "input_proj.weight");
        attention(M.block, pre);
        M.block.gate_up = lin(pre + "mlp.gate_up_proj.weight");
        M.block.down    = lin(pre + "mlp.down_proj.weight");
        M.final_norm  = vec(pre + "final_layernorm.weight");
    }
    if (device && n_small > 0) {  // the kernels read the norms and biases from device memory
        float * d = small_store->floats(n_small);
        device->upload(d, w.small_f32.data(), n_small * static_cast<int64_t>(sizeof(float)));
        auto rebase = [&](const float *& p) {
            if (p) { p = d + (p - w.small_f32.data()); }
        };
        for (LayerWeights & L : w.layers) {
            for (const float ** p : {&L.attn_norm, &L.bqkv, &L.q_norm, &L.k_norm, &L.mlp_norm}) { rebase(*p); }
        }
        rebase(w.final_norm);
        for (MtpWeights & M : w.mtp) {
            for (const float ** p : {&M.token_norm, &M.hidden_norm, &M.final_norm, &M.block.attn_norm, &M.block.bqkv, &M.block.q_norm,
                                      &M.block.k_norm, &M.block.mlp_norm}) {
                rebase(*p);
            }
        }
    }
    return w;
}

}  // namespace fd::model