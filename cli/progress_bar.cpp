#include "progress_bar.h"

#include <fmt/format.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>

namespace fdctl {

ProgressBar::ProgressBar(std::string url, std::string api_key, std::string op)
    : url_(std::move(url)), api_key_(std::move(api_key)), op_(std::move(op)) {
    thread_ = std::thread([this] { run(); });
}

ProgressBar::~ProgressBar() {
    {
        std::lock_guard lk(mu_);
        stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
    if (drawn_) { std::fputs("\r\033[K", stderr); }
}

std::string ProgressBar::render(const std::string & op, const std::string & progress_json, int width) {
    const auto p = nlohmann::json::parse(progress_json, nullptr, false);
    if (!p.is_object()) { return ""; }
    const double mib   = 1048576.0;
    const auto   done  = p.value("bytes_done", int64_t{0});
    const auto   total = p.contains("bytes_total") && p["bytes_total"].is_number() ? p["bytes_total"].get<int64_t>() : int64_t{0};
    const std::string phase = p.value("phase", "");
    const double secs = p.value("elapsed_s", 0.0);
    if (total <= 0) { return fmt::format("{} {} {:.1f} MiB  {:.1f} s", op, phase, static_cast<double>(done) / mib, secs); }
    const double frac = std::min(1.0, static_cast<double>(done) / static_cast<double>(total));
    const int    fill = static_cast<int>(frac * width + 0.5);
    return fmt::format("{} {} [{}{}] {:3d}%  {:.1f} / {:.1f} MiB  {:.1f} s", op, phase, std::string(static_cast<size_t>(fill), '#'),
                       std::string(static_cast<size_t>(width - fill), '.'), static_cast<int>(frac * 100), static_cast<double>(done) / mib,
                       static_cast<double>(total) / mib, secs);
}

void ProgressBar::run() {
    httplib::Client cli(url_);
    if (!cli.is_valid()) { return; }
    cli.set_connection_timeout(0, 300000);
    cli.set_read_timeout(1, 0);
    if (!api_key_.empty()) { cli.set_bearer_token_auth(api_key_); }
    std::unique_lock lk(mu_);
    // The first poll after 300 ms: short operations finish without drawing anything.
    while (!cv_.wait_for(lk, std::chrono::milliseconds(drawn_ ? 200 : 300), [&] { return stop_; })) {
        lk.unlock();
        std::string line;
        if (auto res = cli.Get("/health"); res && !res->body.empty()) {
            const auto h = nlohmann::json::parse(res->body, nullptr, false);
            if (h.is_object() && h.contains("progress") && h["progress"].is_object()) { line = render(op_, h["progress"].dump()); }
        }
        lk.lock();
        if (stop_) { break; }
        if (!line.empty()) {
            std::fprintf(stderr, "\r\033[K%s", line.c_str());
            std::fflush(stderr);
            drawn_ = true;
        }
    }
}

}  // namespace fdctl
