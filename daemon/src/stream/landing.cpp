// A weight stream landed into a rank's staging region (fd/stream/landing.h): the parts of a
// layout as byte ranges, and the receiver thread that fills them from the trainer's connection.
#include "fd/stream/landing.h"

#include "fd/liveness.h"
#include "fd/log.h"
#include "fd/deadline.h"
#include "fd/status.h"
#include "stream_io.h"

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>

namespace fd::stream {

std::vector<LandPart> land_parts(const model::WeightLayout & layout) {
    std::vector<LandPart> out;
    for (const model::InferenceTensor & t : layout.tensors) {
        const int64_t es        = model::dtype_size(t.dtype);
        const int64_t row_elems = t.shape.size() == 2 ? t.shape[1] : 1;
        const int64_t row_bytes = row_elems * es;
        int64_t covered = 0;
        for (const model::WeightPart & p : t.parts) {
            LandPart l{.hf_name = p.hf_name, .offset = t.offset + p.row0 * row_bytes, .nbytes = p.rows * row_bytes, .dtype = t.dtype,
                       .dim = p.dim, .src0 = p.src0, .n = p.dim == 0 ? p.rows : row_elems, .hf_shape = p.hf_shape};
            const int64_t hf_row_elems = p.hf_shape.size() == 2 ? p.hf_shape[1] : 1;
            const bool fits = p.dim == 0 ? hf_row_elems == row_elems && p.src0 + p.rows <= p.hf_shape[0]
                                         : p.hf_shape.size() == 2 && p.rows == p.hf_shape[0] && p.src0 + row_elems <= p.hf_shape[1];
            if (!fits) {
                fail(Errc::wrong_state, "tensor '{}' (part '{}') is not one byte range of the rollout's layout; land the stream through the "
                                        "daemon instead (a weight stream without \"land\")", t.name, p.hf_name);
            }
            covered += l.nbytes;
            out.push_back(std::move(l));
        }
        if (covered != t.bytes) {
            fail(Errc::wrong_state, "tensor '{}': its parts cover {} of its {} bytes; land the stream through the daemon instead", t.name,
                 covered, t.bytes);
        }
    }
    return out;
}

int64_t LandedDelta::n_values() const {
    int64_t n = 0;
    for (const Frame & f : frames) { n += f.n; }
    return n;
}

int64_t delta_buffer_bytes(const std::vector<LandPart> & parts) {
    int64_t total = 0;
    for (const LandPart & p : parts) { total += delta_frame_bytes(p, max_delta_elements(p), /*idx64=*/true); }
    return total;
}

struct Landing::State {
    LandMode              mode = LandMode::full;
    std::vector<LandPart> parts;
    std::byte *           base = nullptr;
    DeltaBuffer           buffer;          ///< delta: where the frames are kept
    std::vector<LandedDelta::Frame> frames;  ///< delta: the frames received
    bool                  check_finite = true;
    Clock::time_point     deadline;
    UniqueFd              listener;
    UniqueFd              conn;
    std::atomic<int>      conn_fd{-1};     ///< conn's fd once accepted (stop() shuts it down)
    int32_t               port = 0;
    std::string           token;
    std::atomic<bool>     stopping{false};
    std::mutex            mu;
    std::condition_variable cv;
    std::vector<char>     got;             ///< per part: arrived (guarded by mu for readers)
    int64_t               n_got = 0;
    bool                  done = false;    ///< every part arrived
    std::optional<Error>  error;           ///< the receiver stopped on this
    std::thread           th;

    std::string first_missing() const {
        for (size_t i = 0; i < parts.size(); ++i) {
            if (!got[i]) { return parts[i].hf_name; }
        }
        return "";
    }

    /// The frame header, or nullopt at a clean end of the connection (between frames).
    std::optional<std::pair<uint64_t, uint64_t>> read_header(int fd) {
        unsigned char h[16];
        bool ended = false;
        read_exact(fd, h, sizeof h, deadline, "a landing frame header", &ended);
        if (ended) { return std::nullopt; }
        uint64_t off = 0, nb = 0;
        for (int i = 7; i >= 0; --i) {
            off = off << 8 | h[i];
            nb  = nb << 8 | h[8 + i];
        }
        return std::make_pair(off, nb);
    }

    void mark_done() {
        std::lock_guard lk(mu);
        done = true;
        cv.notify_all();
    }

    /// A delta landing's frames until its end frame (LandMode::delta in landing.h).
    void receive_delta(const std::unordered_map<uint64_t, size_t> & by_offset) {
        for (;;) {
            const auto h = read_header(conn.get());
            if (!h) {
                fail(Errc::source_unavailable, "the trainer closed its landing connection before the delta's end frame ({} frame(s) "
                                               "arrived); nothing was applied", frames.size());
            }
            if (h->first == kDeltaEnd) {  // frames only grows on this thread: read without the lock
                if (h->second != frames.size()) {
                    fail(Errc::invalid_argument, "the delta's end frame counts {} frame(s) for this rank, {} arrived; nothing was applied",
                         h->second, frames.size());
                }
                return mark_done();
            }
            if (!(h->first & kDeltaFrame)) {
                fail(Errc::invalid_argument, "a full part frame (offset {}) on a delta landing: send (indices, values) frames "
                                             "(start_weight_update had a base_version)", h->first);
            }
            const uint64_t off = h->first & ~(kDeltaFrame | kDeltaIndices64);
            const auto it = by_offset.find(off);
            if (it == by_offset.end()) {
                fail(Errc::invalid_argument, "a delta frame at offset {} is no part this rank expects (the start answer lists each part's "
                                             "offset)", off);
            }
            const LandPart & p = parts[it->second];
            if (got[it->second]) { fail(Errc::invalid_argument, "tensor '{}': a second delta frame for its part at offset {}", p.hf_name, p.offset); }
            const LandedDelta::Frame f = read_delta_frame(conn.get(), p, static_cast<int32_t>(it->second), h->second,
                                                          (h->first & kDeltaIndices64) != 0, buffer, deadline, check_finite);
            std::lock_guard lk(mu);  // wait() reads how many arrived
            frames.push_back(f);
            got[it->second] = 1;
        }
    }

    void receive() {
        conn = tcp_accept_trainer(listener.get(), token, deadline);
        conn_fd.store(conn.get());
        if (stopping.load()) { return; }  // stop() may have looked before conn_fd was set
        std::unordered_map<uint64_t, size_t> by_offset;
        for (size_t i = 0; i < parts.size(); ++i) { by_offset.emplace(static_cast<uint64_t>(parts[i].offset), i); }
        if (mode == LandMode::delta) { return receive_delta(by_offset); }
        for (;;) {
            const auto h = read_header(conn.get());
            if (!h) {
                if (n_got == static_cast<int64_t>(parts.size())) { return; }
                fail(Errc::invalid_checkpoint, "the update is missing {} of this rank's {} parts (the first: tensor '{}'): the trainer "
                                               "closed its landing connection without them; nothing was applied",
                     parts.size() - n_got, parts.size(), first_missing());
            }
            const auto it = by_offset.find(h->first);
            if (it == by_offset.end() || static_cast<uint64_t>(parts[it->second].nbytes) != h->second) {
                fail(Errc::invalid_argument, "a landing frame of {} bytes at offset {} is no part this rank expects (the start answer lists "
                                             "each part's offset and nbytes)", h->second, h->first);
            }
            const LandPart & p = parts[it->second];
            if (got[it->second]) { fail(Errc::invalid_argument, "part '{}' at offset {} arrived twice", p.hf_name, p.offset); }
            const std::string what = fmt::format("part '{}'", p.hf_name);
            const int64_t es = model::dtype_size(p.dtype);
            for (int64_t o = 0; o < p.nbytes;) {
                const int64_t n = std::min<int64_t>(p.nbytes - o, static_cast<int64_t>(kPieceBytes));
                std::byte * dst = base + p.offset + o;
                read_exact(conn.get(), dst, static_cast<size_t>(n), deadline, what);
                if (check_finite) {
                    if (const int64_t bad = first_nonfinite(p.dtype, dst, n / es); bad >= 0) {
                        fail(Errc::invalid_checkpoint, "tensor '{}' holds a non-finite value at element {} of this rank's part (offset {}); "
                                                       "the serving weights stay", p.hf_name, o / es + bad, p.offset);
                    }
                }
                o += n;
            }
            std::lock_guard lk(mu);
            got[it->second] = 1;
            if (++n_got == static_cast<int64_t>(parts.size())) {
                done = true;
                cv.notify_all();
            }
        }
    }

    /// After a refusal: read and drop what the trainer still sends until it closes, stop() or the
    /// deadline, so that its sends never block on this connection (a trainer blocked until its
    /// timeout never reached the finish that names the refusal; a probe).
    void drain() noexcept {
        const int fd = conn.get();
        if (fd < 0) { return; }
        std::vector<char> sink(size_t(64) << 10);
        while (!stopping.load() && Clock::now() < deadline) {
            pollfd p{.fd = fd, .events = POLLIN, .revents = 0};
            if (::poll(&p, 1, 100) < 0 && errno != EINTR) { return; }
            if (!(p.revents & (POLLIN | POLLHUP | POLLERR))) { continue; }
            const ssize_t n = ::recv(fd, sink.data(), sink.size(), 0);
            if (n == 0 || (n < 0 && errno != EINTR && errno != EAGAIN)) { return; }
        }
    }

    void run() {
        bool refused = false;
        try {
            receive();
        } catch (const Error & e) {
            std::lock_guard lk(mu);
            if (!stopping.load()) { error = e; }
            refused = true;
        } catch (const std::exception & e) {
            std::lock_guard lk(mu);
            if (!stopping.load()) { error = Error(Errc::internal, e.what()); }
            refused = true;
        }
        {
            std::lock_guard lk(mu);
            cv.notify_all();
        }
        if (refused && !stopping.load()) {
            log::get("stream")->warn("landing on port {}: {} (the rest of the trainer's bytes are read and dropped; the finish reports "
                                     "this)", port, error ? error->what() : "?");
            drain();
        }
    }
};

Landing::Landing(std::vector<LandPart> parts, std::byte * base, const std::string & host, double timeout_s, bool check_finite)
    : Landing(std::move(parts), base, host, timeout_s, check_finite, LandMode::full, nullptr, 0) {}

Landing::Landing(std::vector<LandPart> parts, std::byte * base, const std::string & host, double timeout_s, bool check_finite, LandMode mode,
                 std::byte * buffer, int64_t buffer_bytes)
    : s_(std::make_unique<State>()) {
    s_->mode         = mode;
    s_->buffer       = DeltaBuffer{.base = buffer, .cap = buffer_bytes};
    if (mode == LandMode::delta) {
        for (const LandPart & p : parts) {
            if (p.nbytes / model::dtype_size(p.dtype) > int64_t{UINT32_MAX}) {
                fail(Errc::wrong_state, "tensor '{}': a part of {} elements is beyond a delta landing's 32-bit element indices; stream the "
                                        "delta through the daemon", p.hf_name, p.nbytes / model::dtype_size(p.dtype));
            }
        }
    }
    s_->parts        = std::move(parts);
    s_->base         = base;
    s_->check_finite = check_finite;
    s_->deadline     = deadline_after(std::max(timeout_s, 0.001));
    s_->got.assign(s_->parts.size(), 0);
    s_->listener = tcp_listen(host, &s_->port);
    s_->token    = random_token();
    s_->th       = std::thread([s = s_.get()] { s->run(); });
}

Landing::Landing(LandMode mode, std::vector<LandPart> parts, std::byte * buffer, int64_t buffer_bytes, const std::string & host,
                 double timeout_s, bool check_finite)
    : Landing(std::move(parts), nullptr, host, timeout_s, check_finite, mode, buffer, buffer_bytes) {}

Landing::~Landing() { stop(); }

int32_t Landing::port() const { return s_->port; }
const std::string & Landing::token() const { return s_->token; }
const std::vector<LandPart> & Landing::parts() const { return s_->parts; }
LandMode Landing::mode() const { return s_->mode; }

LandedDelta Landing::delta() const {
    std::lock_guard lk(s_->mu);
    FD_CHECK(s_->mode == LandMode::delta && s_->done, "Landing::delta() before a delta landing completed");
    return LandedDelta{.frames = s_->frames, .bytes = s_->buffer.base};
}

void Landing::wait(Clock::time_point deadline) {
    liveness::WaitScope waiting;  // bounded by `deadline`: a rank waiting here is not stuck
    std::unique_lock lk(s_->mu);
    s_->cv.wait_until(lk, deadline, [&] { return s_->done || s_->error.has_value(); });
    if (s_->done) { return; }
    if (s_->error) { throw *s_->error; }
    if (s_->mode == LandMode::delta) {
        fail(Errc::timeout, "the landed delta is incomplete at the deadline: {} frame(s) arrived, no end frame", s_->frames.size());
    }
    fail(Errc::timeout, "the landed stream is incomplete at the deadline: {} of {} parts missing (the first: '{}')",
         s_->parts.size() - static_cast<size_t>(s_->n_got), s_->parts.size(), s_->first_missing());
}

void Landing::stop() noexcept {
    if (!s_ || !s_->th.joinable()) { return; }
    s_->stopping.store(true);
    if (s_->listener.valid()) { ::shutdown(s_->listener.get(), SHUT_RDWR); }  // an accept in progress fails
    if (const int fd = s_->conn_fd.load(); fd >= 0) { ::shutdown(fd, SHUT_RDWR); }  // a read in progress ends
    s_->th.join();
}

}  // namespace fd::stream
