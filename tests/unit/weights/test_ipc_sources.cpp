// The same-host weight sources (daemon/src/weights/ipc_snapshot_source.cpp, ipc_source.cpp):
// the ipc_snapshot source's file choice, and the ipc source's record checks. Files are written
// in a fresh temp dir (stories260K copied there) and a private shm object by the test itself.
#include "fd/checkpoint/safetensors.h"
#include "fd/publish/safetensors_write.h"
#include "fd/shm/ipc_weights.h"
#include "fd/status.h"
#include "fd/weights/weight_source.h"
#include "test_util.h"

#include <doctest/doctest.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>

namespace fs = std::filesystem;
using fd::Errc;
using fd::model::DType;

namespace {

const fs::path kStories = fs::path(FD_SOURCE_DIR) / "models" / "stories260K";

using fd::test::TempDir;

using fd::test::error_of;

}  // namespace

TEST_SUITE("ipc_sources") {

TEST_CASE("ipc_snapshot source: parts in ascending integer order, else the single file, else the checkpoint") {
    TempDir d;
    for (const char * f : {"config.json", "model.safetensors"}) { fs::copy_file(kStories / f, d.path / f); }
    auto src = fd::weights::make_ipc_snapshot_source(d.path);
    auto fetch = [&](int rank) { return src->fetch({.rank = rank}); };
    CHECK(fetch(0).index.tensors.count("model.layers.0.self_attn.q_proj.weight") == 1);  // the full checkpoint
    CHECK(fetch(1).index.tensors.count("model.norm.weight") == 1);  // no rank has a snapshot: every rank the full checkpoint
    CHECK(!fetch(0).version);
    auto one = [&](const std::string & file, const std::string & name) {
        fd::publish::write_safetensors(d.path / file, {{name, DType::f32, {1}}}, [](size_t, std::byte * p) { std::memset(p, 0, 4); });
    };
    one("model_state.tp0.safetensors", "single");
    CHECK(fetch(0).index.tensors.count("single") == 1);
    // rank 1 has no snapshot while rank 0 has one: never the full checkpoint (a mix of versions)
    CHECK(error_of([&] { fetch(1); }) == Errc::not_found);
    one("model_state.tp0.part10.safetensors", "ten");
    one("model_state.tp0.part2.safetensors", "two");
    one("model_state.tp0.partx.safetensors", "ignored");
    one("model_state.tp0.part3.safetensors.tmp", "ignored");
    const auto idx = fetch(0).index;
    CHECK(idx.tensors.size() == 2);
    CHECK(idx.tensors.at("ten").file.filename() == "model_state.tp0.part10.safetensors");
    std::ofstream(d.path / "version.yaml") << "step: 12\n";
    CHECK(*fetch(0).version == "12");
    CHECK(*src->fetch({.version = std::string("v9")}).version == "v9");
    auto gone = fd::weights::make_ipc_snapshot_source(d.path / "nope");
    CHECK(error_of([&] { gone->fetch({}); }) == Errc::source_unavailable);
}

TEST_CASE("ipc source: a record is read by its entries; generation checks before and after the copy") {
    namespace shm = fd::shm;
    const int port = 40000 + ::getpid() % 20000;
    const std::string name = shm::ipc_weights_name(port, 0);
    auto src = fd::weights::make_ipc_source(port);
    CHECK(error_of([&] { src->fetch({}); }) == Errc::not_found);
    const int fd = ::shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    REQUIRE(fd >= 0);
    const size_t total = 4096 + 64;
    REQUIRE(::ftruncate(fd, total) == 0);
    auto * base = static_cast<std::byte *>(::mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
    REQUIRE(base != MAP_FAILED);
    auto * h = reinterpret_cast<shm::IpcRecordHeader *>(base);
    auto * e = reinterpret_cast<shm::IpcTensorEntry *>(base + sizeof(shm::IpcRecordHeader));
    h->magic = shm::kIpcMagic;
    h->abi_version = shm::kIpcAbiVersion;
    h->n_tensors = 1;
    std::strcpy(h->version, "v7");
    h->tp_size = 1;
    h->total_bytes = total;
    std::strcpy(e->name, "x");
    e->dtype = shm::kIpcF32;
    e->ndim = 1;
    e->shape[0] = 16;
    e->offset = 4096;
    e->nbytes = 64;
    CHECK(error_of([&] { src->fetch({}); }) == Errc::source_unavailable);  // generation 0: never published
    h->generation.store(3);
    CHECK(error_of([&] { src->fetch({}); }) == Errc::source_unavailable);  // odd: being written
    h->generation.store(4);
    {
        auto ck = src->fetch({});
        CHECK(*ck.version == "v7");
        REQUIRE(ck.index.tensors.count("x") == 1);
        CHECK(ck.index.tensors.at("x").file == "/dev/shm" + name);
        CHECK(ck.index.tensors.at("x").offset_bytes == 4096);
        CHECK(ck.index.total_bytes == 64);
        std::memset(base + 4096, 0x3f, 64);
        std::vector<float> x(16);
        fd::model::read_tensor_raw(ck.index.tensors.at("x"), x.data());  // a plain file read
        CHECK(std::memcmp(x.data(), base + 4096, 64) == 0);
        ck.verify_copied();                                              // nothing moved
        h->generation.store(6);                                          // the trainer republished meanwhile
        CHECK(error_of(ck.verify_copied) == Errc::source_unavailable);
    }
    CHECK(*src->fetch({.version = std::string("mine")}).version == "mine");
    e->offset = 4096 + 8;  // data past the end of the object
    CHECK(error_of([&] { src->fetch({}); }) == Errc::invalid_checkpoint);
    e->offset = 4096;
    e->nbytes = 60;        // not shape x dtype
    CHECK(error_of([&] { src->fetch({}); }) == Errc::invalid_checkpoint);
    e->nbytes = 64;
    e->location = shm::kIpcCudaIpc;
    CHECK(error_of([&] { src->fetch({}); }) == Errc::source_unavailable);
    e->location = shm::kIpcInline;
    h->abi_version = 99;
    CHECK(error_of([&] { src->fetch({}); }) == Errc::invalid_checkpoint);
    ::munmap(base, total);
    ::close(fd);
    ::shm_unlink(name.c_str());
}

}  // TEST_SUITE
