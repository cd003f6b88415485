// Reading safetensors checkpoints (checkpoint/src/safetensors.cpp): F32 / BF16 / F16 tensors,
// sharded checkpoints through the index and directories of shards, and every malformed file
// refused naming the file and the tensor: cut-off data, bad header length or JSON, unsupported
// dtypes, data_offsets that do not tile the data area, overflowing shapes, FIFOs and devices.
// Files are written into a fresh temp dir per test.
#include "fd/checkpoint/safetensors.h"
#include "fd/file_io.h"
#include "fd/model/weights.h"
#include "fd/status.h"
#include "checkpoint_files.h"
#include "test_util.h"

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <sys/stat.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

namespace {

using fd::test::TempDir;

std::vector<float> read_all(const fd::model::TensorInfo & t) {
    std::vector<float> v(static_cast<size_t>(t.numel()));
    fd::model::read_tensor_f32(t, v.data());
    return v;
}

}  // namespace

TEST_SUITE("model::checkpoint_loading") {

TEST_CASE("read_tensor_index and read_tensor_f32 handle F32, BF16 and F16 tensors") {
    TempDir d;
    const std::vector<float>    f32  = {1.5f, -2.0f, 0.0f, 3.25f, 1e-3f, -7.0f};
    const std::vector<uint16_t> bf16 = {0x3F80, 0xC000, 0x4049, 0x7F80};            // 1, -2, 3.140625, inf
    const std::vector<uint16_t> f16  = {0x3C00, 0xC000, 0x7BFF, 0x0001};            // 1, -2, 65504, 2^-24
    const int64_t size = write_safetensors(d.path / "model.safetensors",
        {{"w.f32", "F32", {2, 3}, bytes_of(f32)}, {"w.bf16", "BF16", {4}, bytes_of(bf16)}, {"w.f16", "F16", {2, 2}, bytes_of(f16)}});
    const auto idx = fd::model::read_tensor_index(d.path);
    REQUIRE(idx.tensors.size() == 3);  // __metadata__ is not a tensor
    CHECK(idx.total_bytes == 24 + 8 + 8);
    const auto & a = idx.tensors.at("w.f32");
    const auto & b = idx.tensors.at("w.bf16");
    const auto & c = idx.tensors.at("w.f16");
    CHECK(a.dtype == fd::model::DType::f32);
    CHECK(b.dtype == fd::model::DType::bf16);
    CHECK(c.dtype == fd::model::DType::f16);
    CHECK(a.shape == std::vector<int64_t>{2, 3});
    CHECK(c.numel() == 4);
    CHECK(a.file == d.path / "model.safetensors");
    CHECK(a.size_bytes == 24);
    CHECK(c.offset_bytes + c.size_bytes == size);   // last tensor ends at the end of the file
    CHECK(b.offset_bytes == a.offset_bytes + 24);
    CHECK(std::string(fd::model::dtype_name(b.dtype)) == "BF16");

    CHECK(read_all(a) == f32);
    const auto bv = read_all(b);
    CHECK(bv[0] == 1.0f);
    CHECK(bv[1] == -2.0f);
    CHECK(bv[2] == 3.140625f);
    CHECK(std::isinf(bv[3]));
    const auto cv = read_all(c);
    CHECK(cv == std::vector<float>{1.0f, -2.0f, 65504.0f, std::ldexp(1.0f, -24)});
}

TEST_CASE("a sharded checkpoint is read through model.safetensors.index.json") {
    TempDir d;
    const std::vector<float> x = {1, 2, 3, 4}, y = {5, 6}, z = {7};
    write_safetensors(d.path / "model-00001-of-00002.safetensors", {{"x", "F32", {2, 2}, bytes_of(x)}, {"z", "F32", {1}, bytes_of(z)}});
    write_safetensors(d.path / "model-00002-of-00002.safetensors", {{"y", "F32", {2}, bytes_of(y)}}, false);
    write_text(d.path / "model.safetensors.index.json",
               json{{"metadata", {{"total_size", 28}}},
                    {"weight_map", {{"x", "model-00001-of-00002.safetensors"}, {"z", "model-00001-of-00002.safetensors"},
                                    {"y", "model-00002-of-00002.safetensors"}}}}.dump());
    const auto idx = fd::model::read_tensor_index(d.path);
    REQUIRE(idx.tensors.size() == 3);
    CHECK(idx.total_bytes == 28);
    CHECK(idx.tensors.at("y").file.filename() == "model-00002-of-00002.safetensors");
    CHECK(idx.tensors.at("x").file.filename() == "model-00001-of-00002.safetensors");
    CHECK(read_all(idx.tensors.at("x")) == x);
    CHECK(read_all(idx.tensors.at("y")) == y);
    CHECK(read_all(idx.tensors.at("z")) == z);
}

TEST_CASE("without model.safetensors every *.safetensors file of the directory is read") {
    TempDir d;
    write_safetensors(d.path / "a.safetensors", {{"a", "F32", {1}, bytes_of(std::vector<float>{1})}});
    write_safetensors(d.path / "b.safetensors", {{"b", "F32", {1}, bytes_of(std::vector<float>{2})}});
    write_text(d.path / "notes.txt", "not a checkpoint");
    const auto idx = fd::model::read_tensor_index(d.path);
    CHECK(idx.tensors.size() == 2);
    CHECK(read_all(idx.tensors.at("b")) == std::vector<float>{2});
    TempDir empty;
    expect_invalid([&] { fd::model::read_tensor_index(empty.path); }, {empty.path.string(), "no *.safetensors"});
}

TEST_CASE("a file whose data is cut off is rejected naming the file and the tensor") {
    TempDir d;
    const auto file = d.path / "model.safetensors";
    const int64_t size = write_safetensors(file, {{"first", "F32", {2}, bytes_of(std::vector<float>{1, 2})},
                                                  {"second.weight", "F32", {4}, bytes_of(std::vector<float>{1, 2, 3, 4})}});
    fs::resize_file(file, static_cast<uintmax_t>(size - 5));
    expect_invalid([&] { fd::model::read_tensor_index(d.path); }, {"model.safetensors", "second.weight"});
}

TEST_CASE("read_tensor_f32 reports a short read naming the file and the tensor") {
    TempDir d;
    const auto file = d.path / "model.safetensors";
    const int64_t size = write_safetensors(file, {{"emb", "F32", {8}, bytes_of(std::vector<float>(8, 1.0f))}});
    const auto idx = fd::model::read_tensor_index(d.path);
    fs::resize_file(file, static_cast<uintmax_t>(size - 12));   // truncated after indexing
    std::vector<float> dst(8);
    expect_invalid([&] { fd::model::read_tensor_f32(idx.tensors.at("emb"), dst.data()); }, {"model.safetensors", "emb"});
}

TEST_CASE("a header length past the end of the file is rejected naming the file") {
    TempDir d;
    const auto file = d.path / "model.safetensors";
    const uint64_t n = 1000;
    std::string raw(reinterpret_cast<const char *>(&n), 8);
    raw += R"({"a":{}})";
    write_text(file, raw);
    expect_invalid([&] { fd::model::read_tensor_index(d.path); }, {file.string(), "header length 1000"});
    write_text(file, "abc");   // shorter than the 8-byte length itself
    expect_invalid([&] { fd::model::read_tensor_index(d.path); }, {file.string()});
}

TEST_CASE("a header that is not JSON is rejected naming the file") {
    TempDir d;
    const auto file = d.path / "model.safetensors";
    const std::string header = "{not json";
    const uint64_t n = header.size();
    write_text(file, std::string(reinterpret_cast<const char *>(&n), 8) + header);
    expect_invalid([&] { fd::model::read_tensor_index(d.path); }, {file.string(), "JSON"});
}

TEST_CASE("an unsupported dtype is rejected naming the file, tensor and dtype") {
    TempDir d;
    write_safetensors(d.path / "model.safetensors", {{"ok", "F32", {1}, bytes_of(std::vector<float>{1})},
                                                     {"quant.weight", "I8", {4}, std::string(4, '\1')}});
    expect_invalid([&] { fd::model::read_tensor_index(d.path); }, {"model.safetensors", "quant.weight", "I8"});
}

TEST_CASE("data_offsets that do not match shape times dtype size are rejected") {
    TempDir d;
    // [2, 2] F32 needs 16 bytes; the entry claims 12.
    write_safetensors(d.path / "model.safetensors",
                      {{"bad.weight", "F32", {2, 2}, std::string(16, '\0'), std::make_pair(int64_t(0), int64_t(12))}});
    expect_invalid([&] { fd::model::read_tensor_index(d.path); }, {"model.safetensors", "bad.weight", "16"});
    // BF16 data sized as if it were F32.
    TempDir d2;
    write_safetensors(d2.path / "model.safetensors", {{"half.weight", "BF16", {4}, std::string(16, '\0')}});
    expect_invalid([&] { fd::model::read_tensor_index(d2.path); }, {"half.weight"});
}

TEST_CASE("an index listing a tensor absent from its shard is rejected naming both") {
    TempDir d;
    write_safetensors(d.path / "shard-1.safetensors", {{"present", "F32", {1}, bytes_of(std::vector<float>{1})}});
    write_safetensors(d.path / "shard-2.safetensors", {{"elsewhere", "F32", {1}, bytes_of(std::vector<float>{1})}});
    write_text(d.path / "model.safetensors.index.json",
               json{{"weight_map", {{"present", "shard-1.safetensors"}, {"ghost.weight", "shard-1.safetensors"},
                                    {"elsewhere", "shard-2.safetensors"}}}}.dump());
    expect_invalid([&] { fd::model::read_tensor_index(d.path); }, {"shard-1.safetensors", "ghost.weight"});
    // Listed under the wrong shard counts as absent too.
    write_text(d.path / "model.safetensors.index.json",
               json{{"weight_map", {{"present", "shard-1.safetensors"}, {"elsewhere", "shard-1.safetensors"},
                                    {"x", "shard-2.safetensors"}}}}.dump());
    expect_invalid([&] { fd::model::read_tensor_index(d.path); }, {"elsewhere"});
}

TEST_CASE("a header entry without shape or data_offsets is an invalid_checkpoint error") {
    TempDir d;
    const std::string header = R"({"w":{"dtype":"F32","data_offsets":[0,4]}})";
    const uint64_t n = header.size();
    write_text(d.path / "model.safetensors", std::string(reinterpret_cast<const char *>(&n), 8) + header + "abcd");
    expect_invalid([&] { fd::model::read_tensor_index(d.path); }, {"model.safetensors", "'w'"});
}

// ---- the safetensors data-area rule (issue 12, defect 5) ------------------------------------------

TEST_CASE("data_offsets must tile the data area: start at 0, contiguous, no overlap, no trailing bytes") {
    const std::string four(16, '\1');  // a [4] F32 tensor's bytes
    auto at = [](int64_t b, int64_t e) { return std::make_optional(std::make_pair(b, e)); };
    struct Case {
        const char *           name;
        std::vector<RawTensor> tensors;
        std::string            extra;   ///< bytes appended after the tensors' data
        std::vector<std::string> needles;
    };
    const std::vector<Case> cases = {
        {"overlap", {{"a", "F32", {4}, four, at(0, 16)}, {"b", "F32", {4}, four, at(8, 24)}, {"c", "F32", {2}, std::string(8, '\0'), at(24, 32)}},
         "", {"'b'", "overlaps", "'a'"}},
        {"same range twice", {{"a", "F32", {4}, four, at(0, 16)}, {"b", "F32", {4}, four, at(0, 16)}}, "", {"overlaps"}},
        {"hole", {{"a", "F32", {4}, four, at(0, 16)}, {"b", "F32", {4}, four, at(24, 40)}}, std::string(8, '\0'), {"'b'", "hole", "16"}},
        {"not from 0", {{"a", "F32", {4}, four, at(8, 24)}}, std::string(8, '\0'), {"'a'", "hole"}},
        {"trailing bytes", {{"a", "F32", {4}, four}}, std::string(4, '\0'), {"trailing", "4"}},
        {"past the end", {{"a", "F32", {4}, four, at(0, 16)}, {"b", "F32", {4}, four, at(16, 32)}}, "", {"'b'", "outside"}},
    };
    for (const auto & c : cases) {
        CAPTURE(c.name);
        TempDir d;
        const auto file = d.path / "model.safetensors";
        // The writer concatenates the bytes in order; for "past the end" drop b's bytes.
        std::vector<RawTensor> ts = c.tensors;
        if (std::string(c.name) == "past the end") { ts[1].bytes.clear(); }
        if (std::string(c.name) == "overlap" || std::string(c.name) == "same range twice") {
            for (size_t i = 1; i < ts.size(); ++i) { ts[i].bytes = ts[i].bytes.substr(0, 8); }
        }
        write_safetensors(file, ts);
        if (!c.extra.empty()) { std::ofstream(file, std::ios::binary | std::ios::app) << c.extra; }
        std::vector<std::string> needles = {file.string()};
        needles.insert(needles.end(), c.needles.begin(), c.needles.end());
        expect_invalid([&] { fd::model::read_tensor_index(d.path); }, needles);
    }
}

TEST_CASE("a shape whose byte size overflows 64 bits, a negative dimension or offset is rejected naming the tensor") {
    for (const char * entry : {R"({"big":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,4]}})",
                               R"({"big":{"dtype":"BF16","shape":[4611686018427387904],"data_offsets":[0,4]}})",
                               R"({"big":{"dtype":"F32","shape":[18446744073709551615],"data_offsets":[0,4]}})",
                               R"({"big":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})",
                               R"({"big":{"dtype":"F32","shape":[1],"data_offsets":[-4,0]}})",
                               R"({"big":{"dtype":"F32","shape":[1],"data_offsets":[0,18446744073709551615]}})",
                               R"({"big":{"dtype":"F32","shape":[1.5],"data_offsets":[0,4]}})"}) {
        CAPTURE(entry);
        TempDir d;
        const std::string header = entry;
        const uint64_t n = header.size();
        write_text(d.path / "model.safetensors", std::string(reinterpret_cast<const char *>(&n), 8) + header + "abcd");
        expect_invalid([&] { fd::model::read_tensor_index(d.path); }, {"model.safetensors", "'big'"});
    }
}

TEST_CASE("a well-formed file with zero-size tensors and __metadata__ passes the data-area rule") {
    TempDir d;
    write_safetensors(d.path / "model.safetensors", {{"empty", "F32", {0, 4}, ""}, {"a", "F32", {2}, bytes_of(std::vector<float>{1, 2})},
                                                     {"z", "BF16", {0}, ""}});
    CHECK(fd::model::read_tensor_index(d.path).tensors.size() == 3);
}

TEST_CASE("a FIFO or /dev/zero as model.safetensors is refused at once naming the file") {
    TempDir d;
    const auto file = d.path / "model.safetensors";
    REQUIRE(::mkfifo(file.c_str(), 0600) == 0);
    expect_invalid([&] { fd::model::read_tensor_index(d.path); }, {file.string(), "FIFO"});
    fs::remove(file);
    fs::create_symlink("/dev/zero", file);
    expect_invalid([&] { fd::model::read_tensor_index(d.path); }, {file.string(), "character device"});
    fs::remove(file);
    REQUIRE(::mkfifo((d.path / "model.safetensors.index.json").c_str(), 0600) == 0);
    expect_invalid([&] { fd::model::read_tensor_index(d.path); }, {"model.safetensors.index.json", "FIFO"});
}

}  // TEST_SUITE

TEST_CASE("pread_rows_exact reads a column slice of strided rows and refuses a file cut inside it") {
    // A row-major [rows][cols] of bytes b[r][c] = r * cols + c (mod 251): rank columns [c0, c0 + n).
    TempDir d;
    const auto file = d.path / "rows.bin";
    const int64_t rows = 1200, cols = 96, c0 = 40, n = 24;  // 1200 rows: three preadv calls of up to 512
    std::string raw(static_cast<size_t>(rows * cols), '\0');
    for (int64_t i = 0; i < rows * cols; ++i) { raw[static_cast<size_t>(i)] = static_cast<char>(i % 251); }
    std::ofstream(file, std::ios::binary).write(raw.data(), static_cast<std::streamsize>(raw.size()));
    const fd::UniqueFd f(::open(file.c_str(), O_RDONLY | O_CLOEXEC));
    REQUIRE(f.valid());
    std::vector<std::byte> dst(static_cast<size_t>(rows * n)), gap(static_cast<size_t>(cols - n));
    for (const int64_t first : {int64_t(0), int64_t(7)}) {  // from the first row, and from a later one
        const int64_t k = rows - first;
        fd::model::pread_rows_exact(f.get(), dst.data(), k, n, first * cols + c0, cols, gap.data(), file, "rows");
        int64_t wrong = 0;
        for (int64_t r = 0; r < k; ++r) {
            for (int64_t c = 0; c < n; ++c) {
                wrong += static_cast<int64_t>(dst[static_cast<size_t>(r * n + c)]) != ((first + r) * cols + c0 + c) % 251;
            }
        }
        CHECK(wrong == 0);
    }
    // Cut inside row 700's slice: the preadv stops short, the resume hits the end: an error naming the file.
    fs::resize_file(file, static_cast<uintmax_t>(700 * cols + c0 + 5));
    expect_invalid([&] { fd::model::pread_rows_exact(f.get(), dst.data(), rows, n, c0, cols, gap.data(), file, "rows"); },
                   {"rows.bin", "rows"});
}

TEST_CASE("pread_rows_exact with no gap between the rows reads them as one block") {
    TempDir d;
    const auto file = d.path / "rows.bin";
    std::string raw(3000, '\0');
    for (size_t i = 0; i < raw.size(); ++i) { raw[i] = static_cast<char>(i % 253); }
    std::ofstream(file, std::ios::binary).write(raw.data(), static_cast<std::streamsize>(raw.size()));
    const fd::UniqueFd f(::open(file.c_str(), O_RDONLY | O_CLOEXEC));
    REQUIRE(f.valid());
    std::vector<std::byte> dst(2000);
    fd::model::pread_rows_exact(f.get(), dst.data(), 40, 50, 1000, 50, nullptr, file, "rows");
    CHECK(std::memcmp(dst.data(), raw.data() + 1000, 2000) == 0);
}
