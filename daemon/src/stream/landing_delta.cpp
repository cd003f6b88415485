// A delta landing's frames (fd/stream/landing.h, LandMode::delta): read from the trainer's
// connection into the landing's buffer, checked (indices in range, strictly increasing; values
// finite) and turned into part coordinates while they are in cache, so that applying them between
// forward steps (Worker::land_close) is one pass of swaps.
#include "fd/status.h"
#include "stream_io.h"

#include <cstring>

namespace fd::stream {

namespace {

int64_t align8(int64_t x) { return (x + 7) / 8 * 8; }

struct Bounds {
    int64_t rows = 1, cols = 1;  ///< the training tensor's [rows, cols] (cols 1 for a vector)
    int64_t lo = 0, hi = 0;      ///< the flat indices this part takes
};

Bounds bounds_of(const LandPart & p) {
    Bounds b;
    b.rows = p.hf_shape.empty() ? 1 : p.hf_shape[0];
    b.cols = p.hf_shape.size() == 2 ? p.hf_shape[1] : 1;
    b.lo   = p.dim == 0 ? p.src0 * b.cols : 0;
    b.hi   = p.dim == 0 ? (p.src0 + p.n) * b.cols : b.rows * b.cols;
    return b;
}

template <class Index>
int64_t index_at(const std::byte * idx, int64_t k) {
    Index v;
    std::memcpy(&v, idx + k * static_cast<int64_t>(sizeof(Index)), sizeof(Index));
    return static_cast<int64_t>(v);
}

/// Check and convert the frame's `n` training-tensor indices at `idx` in place into uint32 part
/// indices at `out` (the same bytes: out[k] is written after index k is read), compacting the
/// values at `vals` (es bytes each) for a column part. Returns the elements kept.
template <class Index>
int64_t convert(const LandPart & p, const Bounds & b, std::byte * idx, std::byte * vals, int64_t es, int64_t n) {
    auto * out = reinterpret_cast<uint32_t *>(idx);
    int64_t prev = -1;
    auto check = [&](int64_t i, int64_t k) {
        if (i < b.lo || i >= b.hi) {
            if (i < 0 || i >= b.rows * b.cols) {
                fail(Errc::invalid_argument, "tensor '{}': delta index {} at position {} is outside its {} elements; nothing was applied",
                     p.hf_name, i, k, b.rows * b.cols);
            }
            fail(Errc::invalid_argument, "tensor '{}': delta index {} at position {} is outside this part's elements [{}, {}) (send each part "
                                         "the indices of its rows); nothing was applied", p.hf_name, i, k, b.lo, b.hi);
        }
        if (i <= prev) {
            fail(Errc::invalid_argument, "tensor '{}': delta index {} at position {} is not greater than the one before it ({}): indices "
                                         "must be sorted and unique; nothing was applied", p.hf_name, i, k, prev);
        }
        prev = i;
    };
    if (p.dim == 0) {
        for (int64_t k = 0; k < n; ++k) {
            const int64_t i = index_at<Index>(idx, k);
            check(i, k);
            out[k] = static_cast<uint32_t>(i - b.lo);
        }
        return n;
    }
    // A column part: rows [0, rows), columns [src0, src0 + n) of each; the row found once per row.
    const int64_t c0 = p.src0, nc = p.n;
    int64_t row = -1, row_start = 0, row_end = 0, w = 0;
    for (int64_t k = 0; k < n; ++k) {
        const int64_t i = index_at<Index>(idx, k);
        check(i, k);
        if (i >= row_end) {
            row       = i / b.cols;
            row_start = row * b.cols;
            row_end   = row_start + b.cols;
        }
        const int64_t col = i - row_start;
        if (col < c0 || col >= c0 + nc) { continue; }
        out[w] = static_cast<uint32_t>(row * nc + (col - c0));
        if (w != k) { std::memcpy(vals + w * es, vals + k * es, static_cast<size_t>(es)); }
        ++w;
    }
    return w;
}

}  // namespace

int64_t max_delta_elements(const LandPart & p) {
    const Bounds b = bounds_of(p);
    return b.hi - b.lo;
}

int64_t delta_frame_bytes(const LandPart & p, int64_t n, bool idx64) {
    return align8(n * (idx64 ? 8 : 4)) + align8(n * model::dtype_size(p.dtype));
}

LandedDelta::Frame read_delta_frame(int fd, const LandPart & p, int32_t part, uint64_t n, bool idx64, DeltaBuffer & buf,
                                    Clock::time_point deadline, bool check_finite) {
    const Bounds b = bounds_of(p);
    if (n == 0 || n > static_cast<uint64_t>(b.hi - b.lo)) {
        fail(Errc::invalid_argument, "tensor '{}': a delta frame of {} elements for a part that takes 1 to {}; nothing was applied", p.hf_name,
             n, b.hi - b.lo);
    }
    const int64_t es     = model::dtype_size(p.dtype);
    const int64_t ne     = static_cast<int64_t>(n);
    const int64_t ib     = idx64 ? 8 : 4;
    const int64_t idx_at = align8(buf.used);
    const int64_t val_at = idx_at + align8(ne * ib);
    const int64_t end    = val_at + align8(ne * es);
    if (end > buf.cap) {  // a buffer of delta_buffer_bytes(parts) always fits; the rank's may be smaller (Worker::land_delta_open)
        fail(Errc::invalid_argument, "tensor '{}': a delta frame of {} elements overflows this rank's delta buffer ({} of {} bytes used: a "
                                     "delta near as large as the weights; send a full update instead)", p.hf_name, n, buf.used, buf.cap);
    }
    const std::string what = fmt::format("the delta of '{}'", p.hf_name);
    std::byte * idx  = buf.base + idx_at;
    std::byte * vals = buf.base + val_at;
    read_exact(fd, idx, static_cast<size_t>(ne * ib), deadline, what);
    read_exact(fd, vals, static_cast<size_t>(ne * es), deadline, what);
    if (check_finite) {
        if (const int64_t bad = first_nonfinite(p.dtype, vals, ne); bad >= 0) {
            fail(Errc::invalid_checkpoint, "tensor '{}' holds a non-finite value at delta position {} (index {}); the serving weights stay",
                 p.hf_name, bad, idx64 ? index_at<int64_t>(idx, bad) : index_at<int32_t>(idx, bad));
        }
    }
    const int64_t kept = idx64 ? convert<int64_t>(p, b, idx, vals, es, ne) : convert<int32_t>(p, b, idx, vals, es, ne);
    buf.used = end;
    return LandedDelta::Frame{.part = part, .n = kept, .idx_at = idx_at, .val_at = val_at};
}

}  // namespace fd::stream
