// Content fingerprints and the label rule (daemon/src/weights/fingerprint.cpp): what changes a
// checkpoint's fingerprint (a rewrite, also one that restores the mtime; another header, another
// mtime) and what does not (a second read of the same files), and label_for's cases.
#include "fd/checkpoint/safetensors.h"
#include "fd/publish/safetensors_write.h"
#include "fd/weights/fingerprint.h"
#include "fd/weights/weight_source.h"
#include "test_util.h"

#include <doctest/doctest.h>

#include <sys/stat.h>

#include <chrono>
#include <cstring>
#include <filesystem>

namespace fs = std::filesystem;
using fd::model::DType;
using fd::weights::label_for;

namespace {

/// dir/model.safetensors with one F32 tensor `name` [n] filled with `value`.
void write_one(const fs::path & dir, const std::string & name, int64_t n, float value) {
    fd::publish::write_safetensors(dir / "model.safetensors", {{name, DType::f32, {n}}}, [&](size_t, std::byte * p) {
        for (int64_t i = 0; i < n; ++i) { std::memcpy(p + 4 * i, &value, 4); }
    });
}

std::string fp_of(const fs::path & dir) { return fd::weights::checkpoint_fingerprint(fd::model::read_tensor_index(dir)); }

void set_mtime(const fs::path & p, fs::file_time_type t) { fs::last_write_time(p, t); }

}  // namespace

TEST_SUITE("fingerprint") {

TEST_CASE("checkpoint_fingerprint: stable for the same files, changed by a rewrite, a header or an mtime") {
    fd::test::TempDir d;
    write_one(d.path, "w", 4, 1.0f);
    const fs::path f = d.path / "model.safetensors";
    const auto t0 = fs::last_write_time(f);
    const std::string a = fp_of(d.path);
    CHECK(a.size() == 64);
    CHECK(fp_of(d.path) == a);  // a second read of the same files

    // Same size and header, other values, mtime restored (touch -r), written as writers do (a
    // temp file renamed over it, as write_safetensors does): another inode, so the fingerprint
    // changes (issue #26: it used to miss this). A write in place into the same inode with the
    // mtime restored is still missed (the documented limit; a rename away and back is no change).
    write_one(d.path, "w", 4, 2.0f);
    set_mtime(f, t0);
    const std::string restored = fp_of(d.path);
    CHECK(restored != a);
    CHECK(fp_of(d.path) == restored);  // and stable while nothing happens
    // The same rewrite with its own mtime (what every writer leaves): changed.
    set_mtime(f, t0 + std::chrono::seconds(1));
    CHECK(fp_of(d.path) != a);
    // Another header (name, shape) with the old mtime: changed.
    write_one(d.path, "v", 4, 1.0f);
    set_mtime(f, t0);
    CHECK(fp_of(d.path) != a);
    write_one(d.path, "w", 5, 1.0f);
    set_mtime(f, t0);
    CHECK(fp_of(d.path) != a);
    // The normal source fills it.
    write_one(d.path, "w", 4, 1.0f);
    set_mtime(f, t0);
    CHECK(fd::weights::make_normal_source(d.path)->fetch({}).fingerprint == fp_of(d.path));
}

TEST_CASE("manifest_fingerprint and combine_fingerprints") {
    fd::weights::store::Manifest m;
    m.version = "1";
    m.files["model.safetensors"] = {16, std::string(64, 'a')};
    const std::string a = fd::weights::manifest_fingerprint(m);
    m.version = "2";  // the version name is not content
    CHECK(fd::weights::manifest_fingerprint(m) == a);
    m.files["model.safetensors"].sha256 = std::string(64, 'b');
    CHECK(fd::weights::manifest_fingerprint(m) != a);

    CHECK(fd::weights::combine_fingerprints({a}) == a);
    CHECK(fd::weights::combine_fingerprints({a, a}).size() == 64);
    CHECK(fd::weights::combine_fingerprints({a, a}) != a);
    CHECK(fd::weights::combine_fingerprints({a, ""}).empty());
    CHECK(fd::weights::combine_fingerprints({}).empty());
    CHECK(fd::weights::fingerprint_label(a) == "fp-" + a.substr(0, 16));
}

TEST_CASE("label_for: a label keeps naming the bytes it named; other bytes under it get their fingerprint label") {
    const std::string f1(64, '1'), f2(64, '2');
    const fd::weights::KnownLabels known{{"7", f1}};
    // a version never seen: taken, whatever the bytes
    CHECK(label_for(known, "8", f2) == "8");
    CHECK(label_for(known, "8", f1) == "8");
    // the same bytes under a known label: kept
    CHECK(label_for(known, "7", f1) == "7");
    // other bytes under a known label (files rewritten, version.yaml unchanged): never the old label
    CHECK(label_for(known, "7", f2) == "fp-" + f2.substr(0, 16));
    // a source that cannot fingerprint (ipc): its version
    CHECK(label_for(known, "7", "") == "7");
    CHECK(label_for({}, "7", f2) == "7");
}

TEST_CASE("label_after_reload: unchanged bytes keep the serving label; changed ones follow label_for") {
    const std::string f1(64, '1'), f2(64, '2'), f3(64, '3');
    const fd::weights::KnownLabels known{{"7", f1}, {"8", f2}};
    using fd::weights::label_after_reload;
    CHECK(label_after_reload(known, "8", "7", f2) == "8");       // bytes of 8, version.yaml says 7: still 8
    CHECK(label_after_reload(known, "8", std::nullopt, f2) == "8");
    CHECK(label_after_reload(known, "8", "9", f3) == "9");       // new bytes, a new version
    CHECK(label_after_reload(known, "8", "7", f3) == "fp-" + f3.substr(0, 16));  // 7 named other bytes
    CHECK(label_after_reload(known, "8", std::nullopt, f3) == "fp-" + f3.substr(0, 16));
    CHECK(label_after_reload(known, "8", "7", f1) == "7");       // back to the bytes of 7
    CHECK(label_after_reload(known, "8", "6", "") == "6");       // ipc: the record's version
    CHECK(label_after_reload(known, "8", std::nullopt, "") == "8");
    // the source names none and the bytes are those 7 named (a dir gone, the source reloaded): 7
    CHECK(label_after_reload(known, "8", std::nullopt, f1) == "7");
}

TEST_CASE("label_of_unnamed: bytes nothing names keep the serving label, else a label that named them, else their fingerprint's") {
    const std::string f1(64, '1'), f2(64, '2'), f3(64, '3');
    const fd::weights::KnownLabels known{{"7", f1}, {"8", f2}, {"fp-2222222222222222", f2}};
    using fd::weights::label_of_unnamed;
    CHECK(label_of_unnamed(known, "8", f2) == "8");
    CHECK(label_of_unnamed(known, "fp-2222222222222222", f2) == "fp-2222222222222222");
    CHECK(label_of_unnamed(known, "8", f1) == "7");
    CHECK(label_of_unnamed(known, "7", f2) == "8");  // the first in label order
    CHECK(label_of_unnamed(known, "8", f3) == "fp-" + f3.substr(0, 16));
    CHECK(label_of_unnamed({}, "0", f3) == "fp-" + f3.substr(0, 16));
}

}  // TEST_SUITE
