// The rsync weight source (daemon/src/weights/rsync_source.cpp) on a local-path store: config
// errors name the field, a fetch pulls with the real rsync into staging and the staged dir lives
// exactly as long as `hold`, unknown versions are not_found, `latest` resolves an omitted
// version, and wakeup falls back to --model when the store lacks the serving version.
#include "fd/status.h"
#include "fd/checkpoint/store.h"
#include "fd/weights/weight_source.h"
#include "test_util.h"

#include <doctest/doctest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <string>

namespace fs = std::filesystem;
using namespace fd::weights;

namespace {

using TmpDir = fd::test::TempDir;

const fs::path kStories = fs::path(FD_SOURCE_DIR) / "models" / "stories260K";

/// Publish stories260K as `version` into `root` the way fdctl does (minus the fsyncs).
void publish(const fs::path & root, const std::string & version) {
    const fs::path tmp = root / (".tmp-" + version + "-1");
    fs::create_directories(tmp);
    store::write_manifest(tmp, store::build_manifest(kStories, version, tmp));
    fs::rename(tmp, root / version);
    std::ofstream(root / "latest") << version << "\n";
}

std::string config(const fs::path & store_dir, const fs::path & staging) {
    return R"({"source": ")" + store_dir.string() + R"(", "staging_dir": ")" + staging.string() + R"(", "timeout_s": 30})";
}

/// Nothing is staged: the dir holds at most its pull lock (.pull.lock, kept for the next pull).
bool nothing_staged(const fs::path & staging) {
    for (const auto & e : fs::directory_iterator(staging)) {
        if (e.path().filename() != ".pull.lock") { return false; }
    }
    return true;
}

}  // namespace

TEST_SUITE("rsync_source") {

TEST_CASE("a bad --rsync-config is invalid_argument naming the field") {
    for (const auto & [cfg, field] : std::vector<std::pair<std::string, std::string>>{
             {R"({"staging_dir": "/tmp/x"})", "source"}, {R"({"source": ""})", "source"},
             {R"({"source": "rsync://host"})", "source"}, {R"({"source": "/s", "timeout_s": 0})", "timeout_s"},
             {R"({"source": "/s", "staging_dir": 3})", "staging_dir"}, {R"({"source": "/s", "args": [1]})", "args"},
             {R"({"source": "/s", "rsync": ""})", "rsync"}, {R"({"source": "/s", "extra": 1})", "extra"}}) {
        CAPTURE(cfg);
        try {
            make_rsync_source("/nonexistent", cfg);
            FAIL("accepted");
        } catch (const fd::Error & e) {
            CHECK(e.code() == fd::Errc::invalid_argument);
            CHECK(std::string(e.what()).find(field) != std::string::npos);
        }
    }
    CHECK_THROWS_AS(make_rsync_source("/nonexistent", "[1, 2]"), fd::Error);
    CHECK_THROWS_AS(make_rsync_source("/nonexistent", "{"), fd::Error);
}

TEST_CASE("two ranks' sources share one pull; the last hold to go removes the staged dir") {
    TmpDir t;
    const fs::path root = t.path / "store", staging = t.path / "staging";
    publish(root, "v1");
    auto rank0 = make_rsync_source(kStories, config(root, staging));
    auto rank1 = make_rsync_source(kStories, config(root, staging));  // another process's source in the daemon
    auto c0 = std::make_unique<FetchedCheckpoint>(rank0->fetch({.version = "v1", .verify_checksum = true, .rank = 0}));
    auto c1 = std::make_unique<FetchedCheckpoint>(rank1->fetch({.version = "v1", .verify_checksum = true, .rank = 1}));
    CHECK(c0->transfer_s > 0);
    CHECK(c1->transfer_s == 0);  // shared, not pulled again
    CHECK(c1->index.tensors.at("model.norm.weight").file == staging / "v1" / "model.safetensors");
    c0.reset();
    CHECK(fs::exists(staging / "v1" / "model.safetensors"));  // rank 1 still holds it
    c1.reset();
    CHECK(nothing_staged(staging));
}

TEST_CASE("fetch pulls into staging; hold owns the staged dir") {
    TmpDir t;
    const fs::path root = t.path / "store", staging = t.path / "staging";
    publish(root, "v1");
    auto src = make_rsync_source(kStories, config(root, staging));
    CHECK(src->strategy() == LoadStrategy::rsync);
    {
        FetchedCheckpoint c = src->fetch({.version = "v1", .verify_checksum = true});
        CHECK(c.version == "v1");
        CHECK(c.checksum_verified);
        CHECK(c.index.tensors.count("model.embed_tokens.weight") == 1);
        CHECK(c.index.tensors.begin()->second.file.parent_path() == staging / "v1");
        CHECK(fs::exists(staging / "v1" / "model.safetensors"));
        CHECK(c.transfer_s > 0);
    }
    CHECK(nothing_staged(staging));  // hold released: the staged dir is gone

    SUBCASE("version omitted: the store's latest") {
        CHECK(src->fetch({}).version == "v1");
        CHECK(nothing_staged(staging));
    }
    SUBCASE("unknown version: not_found, nothing left behind") {
        try {
            src->fetch({.version = "v9"});
            FAIL("fetched");
        } catch (const fd::Error & e) {
            CHECK(e.code() == fd::Errc::not_found);
        }
        CHECK(nothing_staged(staging));
    }
    SUBCASE("wakeup: the serving version from the store, else --model") {
        CHECK(src->fetch({.wakeup = true, .serving_version = "v1"}).version == "v1");
        const FetchedCheckpoint c = src->fetch({.wakeup = true, .serving_version = "0"});
        CHECK(c.index.tensors.begin()->second.file.parent_path() == kStories);
        CHECK(nothing_staged(staging));
    }
    SUBCASE("a defensive re-check of the version string") {
        try {
            src->fetch({.version = ".."});
            FAIL("fetched");
        } catch (const fd::Error & e) {
            CHECK(e.code() == fd::Errc::invalid_argument);
        }
    }
    SUBCASE("a store that is not there: source_unavailable") {
        fs::rename(root, t.path / "gone");
        try {
            src->fetch({.version = "v1"});
            FAIL("fetched");
        } catch (const fd::Error & e) {
            CHECK(e.code() == fd::Errc::source_unavailable);
        }
    }
}

}  // TEST_SUITE
