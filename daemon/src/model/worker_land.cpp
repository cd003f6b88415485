// Worker's landing (fd/model/worker.h land_open / land_close, fd/stream/landing.h): a weight
// stream's frames written straight into the staging region by a receiver thread.
#include "fd/model/worker.h"

#include "fd/deadline.h"
#include "fd/log.h"
#include "fd/publish/safetensors_write.h"
#include "fd/status.h"
#include "fd/stream/landing.h"

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstring>

namespace fd::model {

using Tag = memory::Tag;

std::string Worker::land_open(const std::string & host, double timeout_s) {
    if (device_mem_) {
        fail(Errc::wrong_state, "rank {}: landing writes host memory and this rank's weights are device memory; stream through the "
                                "daemon instead (a weight stream without \"land\")", wcfg_.rank);
    }
    if (!alloc_->resident(Tag::weight)) { fail(Errc::wrong_state, "rank {}: the weights are asleep; POST /v1/wakeup?tags=weight first", wcfg_.rank); }
    stop_landing();
    staged_  = false;
    buckets_ = {};
    std::vector<stream::LandPart> parts = stream::land_parts(layout_);
    std::byte * base = region(Tag::staging, layout_.arena_bytes, /*populate=*/true);  // resident: the receive writes at memory speed
    land_ = std::make_unique<stream::Landing>(std::move(parts), base, host, timeout_s, wcfg_.check_finite_weights);
    nlohmann::json jp = nlohmann::json::array();
    for (const stream::LandPart & p : land_->parts()) {
        jp.push_back({p.hf_name, p.offset, p.nbytes, dtype_name(p.dtype), p.dim, p.src0, p.n, p.hf_shape});
    }
    log::get("model")->info("rank={} | landing a weight stream: {} parts, {} bytes, on port {}", wcfg_.rank, jp.size(), layout_.arena_bytes,
                            land_->port());
    return nlohmann::json{{"rank", wcfg_.rank}, {"host", host}, {"port", land_->port()}, {"token", land_->token()}, {"timeout_s", timeout_s},
                          {"parts", std::move(jp)}}
        .dump();
}

int64_t Worker::land_close(double timeout_s) {
    if (!land_) { fail(Errc::wrong_state, "rank {}: no landing is open (it was stopped by another weight operation, or never opened)", wcfg_.rank); }
    const auto deadline = deadline_after(timeout_s);
    try {
        land_->wait(deadline);
    } catch (...) {
        stop_landing();
        throw;
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
