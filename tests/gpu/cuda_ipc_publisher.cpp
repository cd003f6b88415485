// tests/gpu/cuda_ipc_publisher.cpp — turn a host `ipc` weight record (written by
// `fdctl publish --strategy ipc`) into its GPU form: every tensor copied into one device
// allocation and the entries rewritten as CUDA IPC handles (fd/shm/ipc_weights.h), under the
// record's seqlock. The handles stay valid while this process lives: it prints "ready" and
// waits for stdin to close. Built only with CUDA; used by tests/e2e/test_cuda_ipc.py.
//   cuda_ipc_publisher --probe          exit 0 if a CUDA device is visible, 77 if not
//   cuda_ipc_publisher RECORD_PATH      convert, print "ready", wait for EOF on stdin
#include "fd/shm/ipc_weights.h"

#include <cuda_runtime_api.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <iostream>
#include <string>

namespace {

int die(const std::string & what, cudaError_t err = cudaSuccess) {
    std::fprintf(stderr, "cuda_ipc_publisher: %s%s%s\n", what.c_str(), err != cudaSuccess ? ": " : "",
                 err != cudaSuccess ? cudaGetErrorString(err) : "");
    return 1;
}

}  // namespace

int main(int argc, char ** argv) {
    int n_dev = 0;
    const cudaError_t probe = cudaGetDeviceCount(&n_dev);
    if (argc == 2 && std::string(argv[1]) == "--probe") { return probe == cudaSuccess && n_dev > 0 ? 0 : 77; }
    if (argc != 2) { return die("usage: cuda_ipc_publisher RECORD_PATH | --probe"); }
    if (probe != cudaSuccess || n_dev == 0) { return die("no CUDA device", probe); }
    const int fd = ::open(argv[1], O_RDWR);
    struct stat st{};
    if (fd < 0 || ::fstat(fd, &st) != 0) { return die(std::string("cannot open ") + argv[1]); }
    void * p = ::mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) { return die("mmap failed"); }
    auto * base = static_cast<char *>(p);
    auto * h    = reinterpret_cast<fd::shm::IpcRecordHeader *>(base);
    auto * e    = reinterpret_cast<fd::shm::IpcTensorEntry *>(base + sizeof(fd::shm::IpcRecordHeader));
    const uint64_t g = h->generation.load();
    if (h->magic != fd::shm::kIpcMagic || g == 0 || g % 2) { return die("not a complete ipc weight record"); }
    uint64_t total = 0;
    for (uint32_t i = 0; i < h->n_tensors; ++i) { total += (e[i].nbytes + 255) / 256 * 256; }
    void * dev = nullptr;
    cudaError_t err = cudaMalloc(&dev, total);
    if (err != cudaSuccess) { return die("cudaMalloc", err); }
    cudaIpcMemHandle_t handle;
    if ((err = cudaIpcGetMemHandle(&handle, dev)) != cudaSuccess) { return die("cudaIpcGetMemHandle", err); }
    h->generation.store(g + 1);  // odd: being rewritten
    uint64_t pos = 0;
    for (uint32_t i = 0; i < h->n_tensors; ++i) {
        if ((err = cudaMemcpy(static_cast<char *>(dev) + pos, base + e[i].offset, e[i].nbytes, cudaMemcpyHostToDevice)) != cudaSuccess) {
            return die("cudaMemcpy", err);
        }
        e[i].location = fd::shm::kIpcCudaIpc;
        e[i].offset   = pos;
        std::memcpy(e[i].cuda_ipc_handle, &handle, sizeof handle);
        pos += (e[i].nbytes + 255) / 256 * 256;
    }
    h->generation.store(g + 2);
    std::printf("ready\n");
    std::fflush(stdout);
    std::string line;
    while (std::getline(std::cin, line)) {}
    cudaFree(dev);
    return 0;
}
