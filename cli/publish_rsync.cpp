// fdctl publish --strategy rsync: add one version to a versioned store, atomically, with
// fd::publish::publish_to_store (fd/publish/store_writer.h: the steps and their crash safety).
#include "offline.h"

#include "fd/publish/store_writer.h"
#include "fd/status.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <filesystem>
#include <iostream>

namespace fdctl {

int publish_rsync(const PublishOptions & o) {
    const auto t0 = std::chrono::steady_clock::now();
    if (o.store.empty()) { fd::fail(fd::Errc::invalid_argument, "publish --strategy rsync needs --store DIR (the versioned store)"); }
    if (o.version.empty()) { fd::fail(fd::Errc::invalid_argument, "publish --strategy rsync needs --version V"); }
    if (!std::filesystem::is_directory(o.from)) { fd::fail(fd::Errc::not_found, "--from {} is not a checkpoint directory", o.from); }
    const fd::publish::PublishedVersion p = fd::publish::publish_to_store(o.from, o.store, o.version);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (o.json) {
        std::cout << nlohmann::json{{"version", p.version}, {"store", p.store.string()}, {"bytes", p.bytes},
                                    {"files", p.files}, {"tensors", p.tensors}, {"seconds", secs}}.dump()
                  << "\n";
    } else if (!o.quiet) {
        std::cout << fmt::format("published version {} to {}: {} files, {} tensors, {} bytes in {:.3f} s", p.version, p.store.string(),
                                 p.files, p.tensors, p.bytes, secs)
                  << "\n";
    }
    return 0;
}

}  // namespace fdctl
