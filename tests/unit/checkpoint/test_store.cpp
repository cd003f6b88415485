// The rsync store's manifest and hashing (daemon/src/weights/store.cpp): SHA-256 test vectors,
// one-pass file + range digests (and the copy), manifest round trip, and every check of
// check_against_manifest (sizes always, checksums on request, strict file list).
#include "fd/progress.h"
#include "fd/status.h"
#include "fd/checkpoint/store.h"
#include "test_util.h"

#include <doctest/doctest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

namespace fs = std::filesystem;
namespace store = fd::weights::store;

namespace {

using TmpDir = fd::test::TempDir;

void write_bytes(const fs::path & p, const std::string & bytes) {
    std::ofstream(p, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

/// A two-tensor F32 safetensors file: a = [1, 2], b = [3].
std::string tiny_safetensors() {
    std::string header = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})";
    while ((8 + header.size()) % 8 != 0) { header += ' '; }
    std::string out(8, '\0');
    const uint64_t n = header.size();
    std::memcpy(out.data(), &n, 8);
    out += header;
    const float v[3] = {1.f, 2.f, 3.f};
    out.append(reinterpret_cast<const char *>(v), sizeof v);
    return out;
}

fd::Errc code_of(const std::function<void()> & fn, std::string * what = nullptr) {
    try {
        fn();
    } catch (const fd::Error & e) {
        if (what) { *what = e.what(); }
        return e.code();
    }
    return fd::Errc::ok;
}

}  // namespace

TEST_SUITE("weight_store") {

TEST_CASE("sha256 matches the FIPS 180-2 test vectors, incrementally too") {
    CHECK(store::sha256_hex("abc", 3) == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    CHECK(store::sha256_hex("", 0) == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
    store::Sha256 h;
    h.update("ab", 2);
    h.update("c", 1);
    CHECK(h.hex() == store::sha256_hex("abc", 3));
}

TEST_CASE("digest_file hashes the file and its ranges in one pass and can copy it") {
    TmpDir d;
    std::string data(20 << 20, '\0');  // > one 8 MiB chunk, ranges cross chunk borders
    for (size_t i = 0; i < data.size(); ++i) { data[i] = static_cast<char>(i * 131 + 7); }
    write_bytes(d.path / "f", data);
    const std::vector<store::Range> ranges = {{(8 << 20) - 5, 10}, {0, 1}, {100, (16 << 20)}, {int64_t(data.size()) - 3, 3}, {50, 0}};
    const auto dg = store::digest_file(d.path / "f", ranges, d.path / "copy");
    CHECK(dg.size == int64_t(data.size()));
    CHECK(dg.sha256 == store::sha256_hex(data.data(), data.size()));
    REQUIRE(dg.ranges.size() == ranges.size());
    for (size_t i = 0; i < ranges.size(); ++i) {
        CHECK(dg.ranges[i] == store::sha256_hex(data.data() + ranges[i].offset, static_cast<size_t>(ranges[i].size)));
    }
    CHECK(store::digest_file(d.path / "copy", {}).sha256 == dg.sha256);
    CHECK(code_of([&] { store::digest_file(d.path / "f", {{int64_t(data.size()) - 1, 2}}); }) == fd::Errc::invalid_checkpoint);
    CHECK(code_of([&] { store::digest_file(d.path / "missing", {}); }) == fd::Errc::invalid_checkpoint);
    CHECK(code_of([&] { store::digest_file(d.path / "f", {}, d.path / "copy"); }) == fd::Errc::source_unavailable);  // exists
}

TEST_CASE("build, write, read and check a manifest; every damage is caught") {
    TmpDir src, dst;
    write_bytes(src.path / "model.safetensors", tiny_safetensors());
    write_bytes(src.path / "config.json", "{}");
    const auto m = store::build_manifest(src.path, "v1", dst.path);
    CHECK(m.version == "v1");
    REQUIRE(m.files.size() == 2);
    CHECK(m.files.at("config.json").size == 2);
    REQUIRE(m.tensors.size() == 2);
    const float a[2] = {1.f, 2.f};
    CHECK(m.tensors.at("a").sha256 == store::sha256_hex(a, sizeof a));
    CHECK(m.tensors.at("b").file == "model.safetensors");
    store::write_manifest(dst.path, m);
    const auto back = store::read_manifest(dst.path);
    CHECK(back.version == "v1");
    CHECK(back.files.at("model.safetensors").sha256 == m.files.at("model.safetensors").sha256);
    CHECK(back.tensors.at("b").sha256 == m.tensors.at("b").sha256);
    store::check_against_manifest(dst.path, back, true);

    SUBCASE("one flipped byte: checksum_mismatch only with verify_checksum") {
        std::string bytes = tiny_safetensors();
        bytes[bytes.size() - 1] ^= 1;
        write_bytes(dst.path / "model.safetensors", bytes);
        CHECK(code_of([&] { store::check_against_manifest(dst.path, back, false); }) == fd::Errc::ok);
        CHECK(code_of([&] { store::check_against_manifest(dst.path, back, true); }) == fd::Errc::checksum_mismatch);
    }
    SUBCASE("a truncated file is invalid_checkpoint even without verify_checksum") {
        std::string bytes = tiny_safetensors();
        bytes.pop_back();
        write_bytes(dst.path / "model.safetensors", bytes);
        CHECK(code_of([&] { store::check_against_manifest(dst.path, back, false); }) == fd::Errc::invalid_checkpoint);
    }
    SUBCASE("missing and unlisted files") {
        write_bytes(dst.path / "extra.bin", "x");
        CHECK(code_of([&] { store::check_against_manifest(dst.path, back, false); }) == fd::Errc::invalid_checkpoint);
        fs::remove(dst.path / "extra.bin");
        fs::remove(dst.path / "config.json");
        CHECK(code_of([&] { store::check_against_manifest(dst.path, back, false); }) == fd::Errc::invalid_checkpoint);
    }
    SUBCASE("a tensor hash that does not match") {
        auto bad = back;
        bad.tensors["a"].sha256 = std::string(64, '0');
        CHECK(code_of([&] { store::check_against_manifest(dst.path, bad, true); }) == fd::Errc::checksum_mismatch);
        bad = back;
        bad.tensors["ghost"] = {"model.safetensors", std::string(64, '0')};
        CHECK(code_of([&] { store::check_against_manifest(dst.path, bad, true); }) == fd::Errc::checksum_mismatch);
    }
    SUBCASE("missing or malformed manifest") {
        fs::remove(dst.path / "manifest.json");
        CHECK(code_of([&] { store::read_manifest(dst.path); }) == fd::Errc::invalid_checkpoint);
        write_bytes(dst.path / "manifest.json", R"({"format": "fdrollout-store/1", "version": "v1", "files": {"../x": {"size": 1, "sha256": "00"}}})");
        CHECK(code_of([&] { store::read_manifest(dst.path); }) == fd::Errc::invalid_checkpoint);
        write_bytes(dst.path / "manifest.json", "{not json");
        CHECK(code_of([&] { store::read_manifest(dst.path); }) == fd::Errc::invalid_checkpoint);
    }
}

TEST_CASE("a delta version's manifest: base_version and base_fingerprint round-trip and are checked") {
    TmpDir d;
    const std::string sha(64, 'a');
    const std::string files = R"("files": {"weights.fddelta": {"size": 3, "sha256": ")" + sha + R"("}})";
    auto manifest = [&](const std::string & extra) {
        write_bytes(d.path / "manifest.json", R"({"format": "fdrollout-store/1", "version": "v2", )" + files + extra + "}");
    };
    manifest(R"(, "base_version": "v1", "base_fingerprint": ")" + std::string(64, 'b') + "\"");
    auto m = store::read_manifest(d.path);
    CHECK(m.base_version == "v1");
    CHECK(m.base_fingerprint == std::string(64, 'b'));
    store::write_manifest(d.path, m);
    const auto back = store::read_manifest(d.path);
    CHECK(back.base_version == "v1");
    CHECK(back.base_fingerprint == m.base_fingerprint);
    manifest("");  // a full version
    CHECK(store::read_manifest(d.path).base_version.empty());
    for (const std::string & bad : std::vector<std::string>{R"(, "base_version": "v1")",                                                   // no fingerprint
                                  R"(, "base_version": "v1", "base_fingerprint": "xyz")",                      // not hex
                                  R"(, "base_version": "../x", "base_fingerprint": ")" + sha + "\"",           // not a version
                                  R"(, "base_version": "v2", "base_fingerprint": ")" + sha + "\""}) {          // itself
        manifest(bad);
        CHECK(code_of([&] { store::read_manifest(d.path); }) == fd::Errc::invalid_checkpoint);
    }
}

TEST_CASE("remove_stale_temps removes entries of dead pids only") {
    TmpDir d;
    pid_t dead = ::fork();
    if (dead == 0) { ::_exit(0); }
    REQUIRE(dead > 0);
    ::waitpid(dead, nullptr, 0);
    fs::create_directory(d.path / (".tmp-v1-" + std::to_string(dead)));
    fs::create_directory(d.path / (".tmp-v2-" + std::to_string(::getpid())));
    fs::create_directory(d.path / ".tmp-v3-notapid");
    CHECK(store::remove_stale_temps(d.path, ".tmp-") == 1);
    CHECK_FALSE(fs::exists(d.path / (".tmp-v1-" + std::to_string(dead))));
    CHECK(fs::exists(d.path / (".tmp-v2-" + std::to_string(::getpid()))));
    CHECK(fs::exists(d.path / ".tmp-v3-notapid"));
}

}  // TEST_SUITE

TEST_CASE("a manifest lists the checkpoint's files only: weights, config, tokenizer, generation config, version") {
    TmpDir src, dst;
    write_bytes(src.path / "model.safetensors", tiny_safetensors());
    for (const char * f : {"config.json", "generation_config.json", "tokenizer.model", "tokenizer.json", "tokenizer_config.json",
                           "special_tokens_map.json", "version.yaml", "README.md", "LICENSE", "reference_logits.json",
                           "optimizer.pt", "train_args.json"}) {
        write_bytes(src.path / f, "{}");
    }
    const auto m = store::build_manifest(src.path, "v1", dst.path);
    std::vector<std::string> names;
    for (const auto & [name, f] : m.files) { names.push_back(name); }
    CHECK(names == std::vector<std::string>{"config.json", "generation_config.json", "model.safetensors", "special_tokens_map.json",
                                            "tokenizer.json", "tokenizer.model", "tokenizer_config.json", "version.yaml"});
    CHECK_FALSE(std::filesystem::exists(dst.path / "README.md"));  // not copied either
    CHECK(store::is_checkpoint_file("model-00001-of-00002.safetensors"));
    CHECK(store::is_checkpoint_file("model.safetensors.index.json"));
    CHECK_FALSE(store::is_checkpoint_file("model.safetensors.bak"));
}

TEST_CASE("verifying checksums reports every byte hashed as the verify phase") {
    TmpDir src, dst;
    write_bytes(src.path / "model.safetensors", tiny_safetensors());
    write_bytes(src.path / "config.json", std::string(3000, 'x'));
    const auto m = store::build_manifest(src.path, "v1", dst.path);
    store::write_manifest(dst.path, m);
    store::check_against_manifest(dst.path, m, true);
    const auto last = fd::Progress::current().last();
    REQUIRE(last);
    CHECK(last->phase == "verify");
    const int64_t want = static_cast<int64_t>(fs::file_size(src.path / "model.safetensors") + fs::file_size(src.path / "config.json"));
    CHECK(last->bytes_total == want);
    CHECK(last->bytes_done == want);
}

TEST_CASE("build_manifest: checkpoint names that are not regular files are errors; copies keep their source's read bits") {
    // A probe found a dangling generation_config.json link and a link to /dev/zero silently left
    // out of a published version, a link loop an internal error, and a link to a file only the
    // publisher could read copied world-readable.
    auto base = [](const fs::path & d) {
        write_bytes(d / "model.safetensors", tiny_safetensors());
        write_bytes(d / "config.json", "{}");
    };
    for (const std::string kind : {"dangling", "loop", "device", "fifo"}) {
        TmpDir src, dst;
        base(src.path);
        const fs::path f = src.path / "generation_config.json";
        if (kind == "dangling") { fs::create_symlink(src.path / "nothing-here", f); }
        if (kind == "loop") { fs::create_symlink(f, f); }
        if (kind == "device") { fs::create_symlink("/dev/zero", f); }
        if (kind == "fifo") { REQUIRE(::mkfifo(f.c_str(), 0600) == 0); }
        std::string what;
        const auto code = code_of([&] { store::build_manifest(src.path, "v1", dst.path); }, &what);
        CHECK_MESSAGE(code == fd::Errc::invalid_checkpoint, kind);
        CHECK_MESSAGE(what.find("generation_config.json") != std::string::npos, kind, ": ", what);
    }
    TmpDir src, dst, outside;
    base(src.path);
    write_bytes(outside.path / "secret.json", "{\"s\": 1}");
    fs::permissions(outside.path / "secret.json", fs::perms::owner_read | fs::perms::owner_write);  // 0600
    fs::create_symlink(outside.path / "secret.json", src.path / "tokenizer_config.json");  // followed, as a HF snapshot's links
    fs::permissions(src.path / "config.json", fs::perms::owner_all | fs::perms::group_all | fs::perms::others_all);  // 0777
    const auto m = store::build_manifest(src.path, "v1", dst.path);
    CHECK(m.files.count("tokenizer_config.json") == 1);
    auto mode = [](const fs::path & p) { return fs::status(p).permissions() & fs::perms::mask; };
    CHECK(mode(dst.path / "tokenizer_config.json") == (fs::perms::owner_read | fs::perms::owner_write));  // 0600, as its source
    CHECK(mode(dst.path / "config.json") == (fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read | fs::perms::others_read));  // 0644 at most
    CHECK(mode(dst.path / "model.safetensors") == mode(dst.path / "config.json"));  // umask-independent
}
