// Worker's landing (fd/model/worker.h land_open / land_close, fd/stream/landing.h): a weight
// stream's frames written straight into the staging region by a receiver thread.
#include "fd/model/worker.h"

#include "fd/deadline.h"
#include "fd/log.h"
#include "fd/publish/safetensors_write.h"
#include "fd/status.h"
#include "fd/stream/landing.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstring>

namespace fd::model {

using Tag = memory::Tag;

namespace {

nlohmann::json parts_json(const std::vector<stream::LandPart> & parts) {
    nlohmann::json jp = nlohmann::json::array();
    for (const stream::LandPart & p : parts) { jp.push_back({p.hf_name, p.offset, p.nbytes, dtype_name(p.dtype), p.dim, p.src0, p.n, p.hf_shape}); }
    return jp;
}

}  // namespace

void Worker::check_landable() const {
    if (device_mem_) {
        fail(Errc::wrong_state, "rank {}: landing writes host memory and this rank's weights are device memory; stream through the "
                                "daemon instead (a weight stream without \"land\")", wcfg_.rank);
    }
    if (!alloc_->resident(Tag::weight)) { fail(Errc::wrong_state, "rank {}: the weights are asleep; POST /v1/wakeup?tags=weight first", wcfg_.rank); }
}

std::string Worker::land_open(const std::string & host, double timeout_s) {
    check_landable();
    stop_landing();
    staged_  = false;
    buckets_ = {};
    std::vector<stream::LandPart> parts = stream::land_parts(layout_);
    std::byte * base = region(Tag::staging, layout_.arena_bytes, /*populate=*/true);  // resident: the receive writes at memory speed
    land_ = std::make_unique<stream::Landing>(std::move(parts), base, host, timeout_s, wcfg_.check_finite_weights);
    nlohmann::json jp = parts_json(land_->parts());
    log::get("model")->info("rank={} | landing a weight stream: {} parts, {} bytes, on port {}", wcfg_.rank, jp.size(), layout_.arena_bytes,
                            land_->port());
    return nlohmann::json{{"rank", wcfg_.rank}, {"host", host}, {"port", land_->port()}, {"token", land_->token()}, {"timeout_s", timeout_s},
                          {"parts", std::move(jp)}}
        .dump();
}

std::string Worker::land_delta_open(const std::string & host, double timeout_s) {
    check_landable();
    stop_landing();
    forget_weight_delta();
    std::vector<stream::LandPart> parts = stream::land_parts(layout_);
    // Virtual (MAP_NORESERVE): only what frames use is ever touched. At most twice this rank's
    // weights (every frame at its largest is ~2.5-4x them): a bigger delta overflows it and is a 400
    // naming the tensor (send those tensors in full, or a full update).
    const int64_t need = std::min(stream::delta_buffer_bytes(parts), std::max(int64_t{64} << 20, 2 * layout_.arena_bytes));
    if (land_delta_buf_.capacity_bytes() < need) { land_delta_buf_.reserve(need); }
    land_ = std::make_unique<stream::Landing>(stream::LandMode::delta, std::move(parts), land_delta_buf_.data(), land_delta_buf_.capacity_bytes(),
                                              host, timeout_s, wcfg_.check_finite_weights);
    nlohmann::json jp = parts_json(land_->parts());
    log::get("model")->info("rank={} | landing a weight delta: {} parts, on port {}", wcfg_.rank, jp.size(), land_->port());
    return nlohmann::json{{"rank", wcfg_.rank}, {"host", host}, {"port", land_->port()}, {"token", land_->token()}, {"timeout_s", timeout_s},
                          {"mode", "delta"}, {"parts", std::move(jp)}}
        .dump();
}

int64_t Worker::land_close(double timeout_s) {
    if (!land_) { fail(Errc::wrong_state, "rank {}: no landing is open (it was stopped by another weight operation, or never opened)", wcfg_.rank); }
    const auto deadline = deadline_after(timeout_s);
    const auto t0 = std::chrono::steady_clock::now();
    try {
        land_->wait(deadline);
    } catch (...) {
        stop_landing();
        throw;
    }
    if (land_->mode() == stream::LandMode::delta) {
        stream::LandedDelta d = land_->delta();
        std::vector<stream::LandPart> parts = land_->parts();
        stop_landing();
        const auto t1 = std::chrono::steady_clock::now();
        const int64_t n = apply_landed_delta(std::move(d), std::move(parts));
        log::get("model")->info("rank={} | update_weights: the landed delta arrived ({:.3f} s after the finish asked) and {} elements were "
                                "written in place in {:.3f} s", wcfg_.rank, std::chrono::duration<double>(t1 - t0).count(), n,
                                std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count());
        return n;
    }
    int64_t bytes = 0;
    for (const stream::LandPart & p : land_->parts()) { bytes += p.nbytes; }
    stop_landing();
    staged_ = true;
    log::get("model")->info("rank={} | update_weights: the landed stream is complete and staged ({} B)", wcfg_.rank, bytes);
    return bytes;
}

void Worker::stop_landing() noexcept { land_.reset(); }

int64_t Worker::write_snapshot(const std::filesystem::path & file) const {
    if (device_mem_ || !alloc_->resident(Tag::weight)) {
        fail(Errc::wrong_state, "rank {}: a weight snapshot needs resident host weights", wcfg_.rank);
    }
    std::vector<publish::SafetensorsEntry> entries;
    for (const InferenceTensor & t : layout_.tensors) { entries.push_back({t.name, t.dtype, t.shape}); }
    const std::byte * base = alloc_->data(Tag::weight);
    return publish::write_safetensors(file, entries, [&](size_t i, std::byte * dst) {
        const InferenceTensor & t = layout_.tensors[i];
        std::memcpy(dst, base + t.offset, static_cast<size_t>(t.bytes));
    }, 0600);
}

}  // namespace fd::model
