// Checkpoint loading: model config parsing and version.yaml (model_config.cpp), checkpoint
// validation and fill_weights' copy (weights.cpp: non-finite weights, a replaced file, deadlines,
// the staged upload path) and byte-size parsing (config.cpp); reading safetensors files is
// test_safetensors_reading.cpp. Files are written into a fresh temp dir per test.
#include "fd/config.h"
#include "fd/checkpoint/model_config.h"
#include "fd/checkpoint/safetensors.h"
#include "fd/model/weights.h"
#include "fd/kernels/thread_pool.h"
#include "fd/status.h"
#include "checkpoint_files.h"
#include "noop_backend.h"
#include "test_util.h"

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <atomic>
#include <cmath>
#include <limits>
#include <optional>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

namespace {

const fs::path kStories = fs::path(FD_SOURCE_DIR) / "models" / "stories260K";

using fd::test::TempDir;

}  // namespace

TEST_SUITE("model::checkpoint_loading") {

TEST_CASE("load_model_config reads stories260K's config.json and generation_config.json") {
    const auto c = fd::model::load_model_config(kStories);
    CHECK(c.arch == fd::model::Arch::llama);
    CHECK(c.architecture == "LlamaForCausalLM");
    CHECK(c.vocab_size == 512);
    CHECK(c.hidden_size == 64);
    CHECK(c.intermediate_size == 172);
    CHECK(c.n_layers == 5);
    CHECK(c.n_heads == 8);
    CHECK(c.n_kv_heads == 4);
    CHECK(c.head_dim == 8);
    CHECK(c.max_position_embeddings == 512);
    CHECK(c.rms_norm_eps == doctest::Approx(1e-5));
    CHECK(c.rope_theta == 10000.0f);
    CHECK(c.tie_word_embeddings);
    CHECK_FALSE(c.qkv_bias);
    CHECK(c.bos_token_id == 1);
    CHECK(c.eos_token_ids == std::vector<int32_t>{1, 2});
    CHECK(c.q_dim() == 64);
    CHECK(c.kv_dim() == 32);
}

TEST_CASE("load_model_config rejects an unsupported architecture and a missing field") {
    const json base = json::parse(std::ifstream(kStories / "config.json"));
    {
        TempDir d;
        json j = base;
        j["architectures"] = {"MixtralForCausalLM"};
        write_text(d.path / "config.json", j.dump());
        expect_invalid([&] { fd::model::load_model_config(d.path); }, {"config.json", "MixtralForCausalLM"});
    }
    {
        TempDir d;
        json j = base;
        j.erase("hidden_size");
        write_text(d.path / "config.json", j.dump());
        expect_invalid([&] { fd::model::load_model_config(d.path); }, {"config.json", "hidden_size"});
    }
    {
        TempDir d;
        json j = base;
        j["num_key_value_heads"] = 3;
        write_text(d.path / "config.json", j.dump());
        expect_invalid([&] { fd::model::load_model_config(d.path); }, {"num_key_value_heads"});
    }
    {
        TempDir d;
        json j = base;
        j["num_hidden_layers"] = -1;
        write_text(d.path / "config.json", j.dump());
        expect_invalid([&] { fd::model::load_model_config(d.path); }, {"num_hidden_layers"});
    }
    TempDir none;
    expect_invalid([&] { fd::model::load_model_config(none.path); }, {"config.json"});
}

TEST_CASE("load_model_config defaults head_dim and eos ids and reads Qwen2 biases") {
    TempDir d;
    json j = json::parse(std::ifstream(kStories / "config.json"));
    j.erase("head_dim");
    j.erase("num_key_value_heads");
    j["architectures"] = {"Qwen2ForCausalLM"};
    j["eos_token_id"] = 7;
    write_text(d.path / "config.json", j.dump());
    const auto c = fd::model::load_model_config(d.path);
    CHECK(c.arch == fd::model::Arch::qwen2);
    CHECK(c.qkv_bias);
    CHECK(c.head_dim == 8);          // 64 / 8
    CHECK(c.n_kv_heads == 8);        // defaults to n_heads
    CHECK(c.eos_token_ids == std::vector<int32_t>{7});
}

TEST_CASE("validate_checkpoint accepts stories260K and names the offending tensor otherwise") {
    const auto cfg = fd::model::load_model_config(kStories);
    const auto idx = fd::model::read_tensor_index(kStories);
    CHECK(idx.tensors.size() == 48);
    CHECK_NOTHROW(fd::model::validate_checkpoint(cfg, idx));
    {
        auto bad = idx;
        bad.tensors.at("model.layers.2.self_attn.k_proj.weight").shape = {64, 64};
        expect_invalid([&] { fd::model::validate_checkpoint(cfg, bad); },
                       {"model.layers.2.self_attn.k_proj.weight", "[64, 64]", "[32, 64]"});
    }
    {
        auto bad = idx;
        bad.tensors.erase("model.layers.4.mlp.down_proj.weight");
        expect_invalid([&] { fd::model::validate_checkpoint(cfg, bad); }, {"model.layers.4.mlp.down_proj.weight"});
    }
    {
        auto bad = idx;
        auto extra = bad.tensors.at("model.norm.weight");
        extra.name = "model.layers.0.mlp.extra_proj.weight";
        bad.tensors[extra.name] = extra;
        expect_invalid([&] { fd::model::validate_checkpoint(cfg, bad); }, {"model.layers.0.mlp.extra_proj.weight"});
    }
    {
        auto ok = idx;
        ok.tensors.erase("lm_head.weight");   // tied: optional
        auto inv = ok.tensors.at("model.norm.weight");
        inv.name = "model.layers.0.self_attn.rotary_emb.inv_freq";
        ok.tensors[inv.name] = inv;           // ignored buffer
        CHECK_NOTHROW(fd::model::validate_checkpoint(cfg, ok));
        auto untied = cfg;
        untied.tie_word_embeddings = false;
        expect_invalid([&] { fd::model::validate_checkpoint(untied, ok); }, {"lm_head.weight"});
    }
}

TEST_CASE("read_version_step returns the step, nullopt when absent, and throws when malformed") {
    TempDir d;
    CHECK_FALSE(fd::model::read_version_step(d.path).has_value());
    write_text(d.path / "version.yaml", "step: 42\n");
    CHECK(fd::model::read_version_step(d.path) == std::optional<std::string>("42"));
    write_text(d.path / "version.yaml", "name: run-7\nstep: \"v1.2_rc-3\"  # comment\n");
    CHECK(fd::model::read_version_step(d.path) == std::optional<std::string>("v1.2_rc-3"));
    // A `step:` nested under another key is not the version (the old line regex took the first
    // `step:` line at any indentation: "9" here, and "3" for the file without a top-level step).
    write_text(d.path / "version.yaml", "trainer:\n  name: run-7\n  step: 9\nstep: 'v2'\n");
    CHECK(fd::model::read_version_step(d.path) == std::optional<std::string>("v2"));
    write_text(d.path / "version.yaml", "optimizer:\n  step: 3\n");
    CHECK_FALSE(fd::model::read_version_step(d.path).has_value());
    write_text(d.path / "version.yaml", "step: [1, 2]\n");
    expect_invalid([&] { fd::model::read_version_step(d.path); }, {"version.yaml", "step"});
    write_text(d.path / "version.yaml", "step: 'unclosed\n");
    expect_invalid([&] { fd::model::read_version_step(d.path); }, {"version.yaml"});
    write_text(d.path / "version.yaml", "name: run-7\n");
    CHECK_FALSE(fd::model::read_version_step(d.path).has_value());
    write_text(d.path / "version.yaml", "step: a/b\n");
    expect_invalid([&] { fd::model::read_version_step(d.path); }, {"version.yaml", "a/b"});
    write_text(d.path / "version.yaml", "step:\n");
    expect_invalid([&] { fd::model::read_version_step(d.path); }, {"version.yaml"});
    // A probe: `step: ..` became the served weight_version (a request's {"version": ".."} is a 400).
    for (const char * dotted : {"step: ..\n", "step: .\n", "step: .hidden\n"}) {
        write_text(d.path / "version.yaml", dotted);
        expect_invalid([&] { fd::model::read_version_step(d.path); }, {"version.yaml", "not starting with '.'"});
    }
    // Appended to each step: yaml-cpp alone answered the first (1), the trainer's PyYAML the last.
    write_text(d.path / "version.yaml", "step: 1\nstep: 2\n");
    expect_invalid([&] { fd::model::read_version_step(d.path); }, {"version.yaml", "'step' appears 2 times"});
    write_text(d.path / "version.yaml", "step: v1..2\n");  // a dot inside is fine
    CHECK(fd::model::read_version_step(d.path) == std::optional<std::string>("v1..2"));
}

TEST_CASE("parse_bytes understands plain numbers and K/M/G/T suffixes") {
    CHECK(fd::parse_bytes("512MiB") == std::optional<int64_t>(512LL << 20));
    CHECK(fd::parse_bytes("2G") == std::optional<int64_t>(2LL << 30));
    CHECK(fd::parse_bytes("1024") == std::optional<int64_t>(1024));
    CHECK(fd::parse_bytes("4 KiB") == std::optional<int64_t>(4096));
    CHECK(fd::parse_bytes("3kb") == std::optional<int64_t>(3072));
    CHECK(fd::parse_bytes("1T") == std::optional<int64_t>(1LL << 40));
    CHECK(fd::parse_bytes("0") == std::optional<int64_t>(0));
    CHECK_FALSE(fd::parse_bytes("bogus").has_value());
    CHECK_FALSE(fd::parse_bytes("").has_value());
    CHECK_FALSE(fd::parse_bytes("0.3").has_value());
    CHECK_FALSE(fd::parse_bytes("-5M").has_value());
    CHECK_FALSE(fd::parse_bytes("12X").has_value());
    // A decimal part takes a K/M/G/T unit ("0.5MiB" was read as a fraction of memory, a probe)
    CHECK(fd::parse_bytes("1.5GiB") == std::optional<int64_t>(3LL << 29));
    CHECK(fd::parse_bytes("0.5MiB") == std::optional<int64_t>(512LL << 10));
    CHECK(fd::parse_bytes("2.25 K") == std::optional<int64_t>(2304));
    for (const char * bad : {"1.5", "1.5B", "abc.def", ".", "1.", ".5G", "1.5.2G", "9000000000.5G"}) {
        CAPTURE(bad);
        CHECK_FALSE(fd::parse_bytes(bad).has_value());
    }
}

TEST_CASE("parse_fraction reads a bare decimal number only") {
    CHECK(fd::parse_fraction("0.3") == std::optional<double>(0.3));
    CHECK(fd::parse_fraction(".5") == std::optional<double>(0.5));
    CHECK(fd::parse_fraction("1.0") == std::optional<double>(1.0));
    CHECK(fd::parse_fraction("1.5") == std::optional<double>(1.5));  // out of range: the caller says so
    for (const char * bad : {"", ".", "abc.def", "0.5MiB", "1", "0x1.8p0", "1e-1", "-0.5", "0.5.1", "nan"}) {
        CAPTURE(bad);
        CHECK_FALSE(fd::parse_fraction(bad).has_value());
    }
}

TEST_CASE("parse_bytes returns nullopt for sizes that overflow int64") {
    std::optional<int64_t> r;
    CHECK_NOTHROW(r = fd::parse_bytes("99999999999999999999"));
    CHECK_FALSE(r.has_value());
    r = std::nullopt;
    CHECK_NOTHROW(r = fd::parse_bytes("8589934592G"));   // 2^33 * 2^30 = 2^63 > INT64_MAX
    CHECK_FALSE(r.has_value());
    r = std::nullopt;
    CHECK_NOTHROW(r = fd::parse_bytes("99999999999T"));
    CHECK_FALSE(r.has_value());
}

// ---- non-finite weights during the copy (issue 12, defect 8) ------------------------------------

namespace {

/// A one-tensor layout: inference tensor "w" [rows, cols] in memory dtype `mem` from HF tensor "w".
fd::model::WeightLayout one_tensor_layout(int64_t rows, int64_t cols, fd::model::DType stored, fd::model::DType mem) {
    fd::model::WeightLayout L;
    fd::model::InferenceTensor t;
    t.name  = "w";
    t.shape = {rows, cols};
    t.dtype = mem;
    t.bytes = rows * cols * fd::model::dtype_size(mem);
    t.parts = {{"w", 0, rows, stored}};
    L.tensors.push_back(t);
    L.arena_bytes = (t.bytes + 63) / 64 * 64;
    return L;
}

}  // namespace

TEST_CASE("fill_weights refuses a NaN or Inf naming the file, tensor and element, for F32, BF16 and F16 (widened)") {
    using fd::model::DType;
    const int64_t rows = 300, cols = 1000;  // 1.2 MB in F32: several 256 KiB scan pieces
    struct Case { const char * dtype; DType stored, mem; int64_t bad; uint32_t bits; };
    for (const Case & c : {Case{"F32", DType::f32, DType::f32, 0, 0x7fc00000u}, Case{"F32", DType::f32, DType::f32, rows * cols - 1, 0xff800000u},
                           Case{"F32", DType::f32, DType::f32, 123457, 0x7f800000u}, Case{"BF16", DType::bf16, DType::bf16, 200001, 0x7f80u},
                           Case{"BF16", DType::bf16, DType::bf16, 5, 0xffc1u}, Case{"F16", DType::f16, DType::f32, 77777, 0x7e00u},
                           Case{"F16", DType::f16, DType::f32, 299999, 0xfc00u}}) {
        CAPTURE(c.dtype);
        CAPTURE(c.bad);
        TempDir d;
        std::string bytes;
        if (c.stored == DType::f32) {
            std::vector<float> v(static_cast<size_t>(rows * cols), 0.25f);
            std::memcpy(&v[c.bad], &c.bits, 4);
            bytes = bytes_of(v);
        } else {
            std::vector<uint16_t> v(static_cast<size_t>(rows * cols), c.stored == DType::bf16 ? 0x3e80 : 0x3400);  // 0.25
            v[c.bad] = static_cast<uint16_t>(c.bits);
            bytes = bytes_of(v);
        }
        write_safetensors(d.path / "model.safetensors", {{"w", c.dtype, {rows, cols}, bytes}});
        const auto idx = fd::model::read_tensor_index(d.path);
        const auto L = one_tensor_layout(rows, cols, c.stored, c.mem);
        std::vector<std::byte> arena(static_cast<size_t>(L.arena_bytes));
        fd::kernels::ThreadPool pool(2);
        expect_invalid([&] { fd::model::fill_weights(L, idx, arena.data(), &pool); },
                       {"model.safetensors", "'w'", "non-finite", fmt::format("element {}", c.bad)});
        CHECK_NOTHROW(fd::model::fill_weights(L, idx, arena.data(), nullptr, {.check_finite = false}));
    }
}

TEST_CASE("fill_weights copies finite weights exactly and refuses a file replaced after its header was read") {
    using fd::model::DType;
    TempDir d;
    std::vector<float> v(4096);
    for (size_t i = 0; i < v.size(); ++i) { v[i] = std::ldexp(static_cast<float>(i) - 2000.0f, -3); }
    v[7] = std::numeric_limits<float>::max();
    v[8] = std::numeric_limits<float>::denorm_min();
    write_safetensors(d.path / "model.safetensors", {{"w", "F32", {64, 64}, bytes_of(v)}});
    const auto idx = fd::model::read_tensor_index(d.path);
    const auto L = one_tensor_layout(64, 64, DType::f32, DType::f32);
    std::vector<std::byte> arena(static_cast<size_t>(L.arena_bytes));
    fd::model::fill_weights(L, idx, arena.data(), nullptr);
    CHECK(std::memcmp(arena.data(), v.data(), v.size() * 4) == 0);
    // Same name, new inode (a rename over it): the indexed file is gone, nothing is read from the new one.
    write_safetensors(d.path / "model.safetensors.tmp", {{"w", "F32", {64, 64}, bytes_of(v)}});
    fs::rename(d.path / "model.safetensors.tmp", d.path / "model.safetensors");
    try {
        fd::model::fill_weights(L, idx, arena.data(), nullptr);
        FAIL("a replaced file was read");
    } catch (const fd::Error & e) {
        CHECK(e.code() == Errc::source_unavailable);
        CHECK(std::string(e.what()).find("replaced") != std::string::npos);
    }
}

TEST_CASE("fill_weights with an expired deadline is a timeout, not a read") {
    using fd::model::DType;
    TempDir d;
    write_safetensors(d.path / "model.safetensors", {{"w", "F32", {2, 2}, bytes_of(std::vector<float>{1, 2, 3, 4})}});
    const auto idx = fd::model::read_tensor_index(d.path);
    const auto L = one_tensor_layout(2, 2, DType::f32, DType::f32);
    std::vector<std::byte> arena(static_cast<size_t>(L.arena_bytes));
    try {
        fd::model::fill_weights(L, idx, arena.data(), nullptr, {.timeout_s = 1e-9});
        FAIL("no timeout");
    } catch (const fd::Error & e) {
        CHECK(e.code() == Errc::timeout);
    }
}

TEST_CASE("is_loopback_host: only loopback addresses and localhost") {
    for (const char * h : {"127.0.0.1", "127.1.2.3", "::1", "localhost", "::ffff:127.0.0.1"}) { CHECK_MESSAGE(fd::is_loopback_host(h), h); }
    for (const char * h : {"0.0.0.0", "::", "10.0.0.1", "192.168.1.2", "example.com", "::ffff:10.0.0.1", "", "128.0.0.1"}) {
        CHECK_FALSE_MESSAGE(fd::is_loopback_host(h), h);
    }
}

namespace {

/// A CPU backend that counts uploads and hands out "pinned" host memory (malloc), to see that
/// fill_weights' staged path (FillOptions::upload_to) writes only through upload().
class CountingBackend final : public fd::test::NoOpsBackend {
public:
    std::unique_ptr<fd::kernels::Backend> cpu = fd::kernels::make_cpu_backend(1);
    std::atomic<int64_t> uploads{0}, upload_bytes{0}, max_upload{0}, pinned{0};
    std::atomic<int>     in_upload{0}, overlapping{0};

    const char * name() const override { return "counting"; }
    fd::kernels::DeviceKind kind() const override { return fd::kernels::DeviceKind::cpu; }
    bool host_visible() const override { return false; }
    fd::kernels::ThreadPool * host_pool() override { return cpu->host_pool(); }
    void * alloc(int64_t b) override { return cpu->alloc(b); }
    void free(void * p) noexcept override { cpu->free(p); }
    void upload(void * dst, const void * src, int64_t b) override {
        if (in_upload.fetch_add(1) != 0) { overlapping.fetch_add(1); }  // uploads must be one at a time
        uploads.fetch_add(1);
        upload_bytes.fetch_add(b);
        for (int64_t m = max_upload.load(); b > m && !max_upload.compare_exchange_weak(m, b);) {}
        cpu->upload(dst, src, b);
        in_upload.fetch_sub(1);
    }
    void download(void * dst, const void * src, int64_t b) override { cpu->download(dst, src, b); }
    void copy(void * dst, const void * src, int64_t b) override { cpu->copy(dst, src, b); }
    void synchronize() override {}
    fd::kernels::MemInfo mem_info() override { return cpu->mem_info(); }
    void * alloc_pinned_host(int64_t b) override {
        pinned.fetch_add(1);
        return std::malloc(static_cast<size_t>(b));
    }
    void free_pinned_host(void * p) noexcept override { std::free(p); }
};

}  // namespace

TEST_CASE("fill_weights through upload_to: every byte arrives by upload, one at a time, in pieces of <= 16 MiB, bounce "
          "buffers pinned (one per pool thread); the result equals the direct fill; a NaN is still refused") {
    using fd::model::DType;
    TempDir d;
    const int64_t rows = 3000, cols = 1500;  // 4.5M F16 values = 9 MB stored, 18 MB widened: several jobs
    std::vector<uint16_t> v(static_cast<size_t>(rows * cols));
    for (size_t i = 0; i < v.size(); ++i) { v[i] = static_cast<uint16_t>(0x3000 + i % 0x0b00); }  // finite F16
    write_safetensors(d.path / "model.safetensors", {{"w", "F16", {rows, cols}, bytes_of(v)}});
    const auto idx = fd::model::read_tensor_index(d.path);
    const auto L = one_tensor_layout(rows, cols, DType::f16, DType::f32);
    std::vector<std::byte> direct(static_cast<size_t>(L.arena_bytes)), staged(static_cast<size_t>(L.arena_bytes));
    fd::kernels::ThreadPool pool(3);
    fd::model::fill_weights(L, idx, direct.data(), &pool);
    CountingBackend be;
    fd::model::fill_weights(L, idx, staged.data(), &pool, {.upload_to = &be});
    CHECK(std::memcmp(direct.data(), staged.data(), static_cast<size_t>(rows * cols * 4)) == 0);
    CHECK(be.upload_bytes.load() == rows * cols * 4);
    CHECK(be.uploads.load() >= 2);
    CHECK(be.max_upload.load() <= (int64_t{16} << 20));
    CHECK(be.overlapping.load() == 0);
    CHECK(be.pinned.load() == 3);
    // A NaN through the staged path: refused, naming the element.
    v[2000001] = 0x7e00;
    TempDir d2;
    write_safetensors(d2.path / "model.safetensors", {{"w", "F16", {rows, cols}, bytes_of(v)}});
    const auto idx2 = fd::model::read_tensor_index(d2.path);
    expect_invalid([&] { fd::model::fill_weights(L, idx2, staged.data(), &pool, {.upload_to = &be}); },
                   {"'w'", "non-finite", "element 2000001"});
}

}  // TEST_SUITE
