// fd_gpu_bench: the GPU micro-benchmark of scripts/gpu_check.sh. Prints one JSON object:
//   memcpy      device-to-device copy bandwidth (read + write bytes / s), the reference;
//   linear      one ~1B-shaped BF16 decoder layer's linears (Llama-3.2-1B: hidden 2048, 32 q / 8 kv
//               heads of 64, intermediate 8192) through fd::kernels::cuda::linear at B = 1, 64, 256:
//               seconds, weight bytes/s ÷ the memcpy bandwidth, TFLOP/s, and cuBLAS (bf16 x bf16,
//               f32 accumulate, heuristics) on the same shapes as a speed reference;
//   vmm         the CUDA allocator's release / reacquire (zero-filled) seconds and the freed fraction (cudaMemGetInfo);
//   decode      (with a model dir, argv[2]) a Worker's decode tok/s at B = 1, 64, 256, eager and with
//               CUDA graphs, weight bytes/s ÷ memcpy at B = 1 (gpu_decode_bench.h).
// Usage: fd_gpu_bench [SECONDS_PER_POINT [MODEL_DIR]]. Exits 77 with {"gpu": false, ...} where no GPU is visible.
#include "fd/kernels/cuda_ops.h"
#include "gpu_decode_bench.h"
#include "fd/memory/cuda_vmm_allocator.h"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace KC = fd::kernels::cuda;
using nlohmann::json;

namespace {

void ck(cudaError_t e, const char * what) {
    if (e != cudaSuccess) { throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e)); }
}
void ckb(cublasStatus_t s, const char * what) {
    if (s != CUBLAS_STATUS_SUCCESS) { throw std::runtime_error(std::string(what) + ": cuBLAS status " + std::to_string(s)); }
}

/// Median-free simple timing: warm up twice, then average `reps` runs of `fn` with CUDA events.
template <typename F>
double time_s(F && fn, int reps) {
    fn();
    fn();
    cudaEvent_t a, b;
    ck(cudaEventCreate(&a), "event");
    ck(cudaEventCreate(&b), "event");
    ck(cudaEventRecord(a), "record");
    for (int i = 0; i < reps; ++i) { fn(); }
    ck(cudaEventRecord(b), "record");
    ck(cudaEventSynchronize(b), "sync");
    float ms = 0;
    ck(cudaEventElapsedTime(&ms, a, b), "elapsed");
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    return ms / 1e3 / reps;
}

template <typename T>
T * dev_random(size_t n, std::mt19937 & rng) {
    std::vector<T>                        h(n);
    std::uniform_real_distribution<float> d(-1.0f, 1.0f);
    for (auto & x : h) {
        const float f = d(rng);
        if constexpr (sizeof(T) == 2) {
            uint32_t bits;
            std::memcpy(&bits, &f, 4);
            x = static_cast<T>(bits >> 16);
        } else {
            x = f;
        }
    }
    T * p = nullptr;
    ck(cudaMalloc(reinterpret_cast<void **>(&p), sizeof(T) * n), "cudaMalloc");
    ck(cudaMemcpy(p, h.data(), sizeof(T) * n, cudaMemcpyHostToDevice), "upload");
    return p;
}

size_t free_bytes() {
    size_t f = 0, t = 0;
    ck(cudaDeviceSynchronize(), "sync");
    ck(cudaMemGetInfo(&f, &t), "cudaMemGetInfo");
    return f;
}

}  // namespace

int main(int argc, char ** argv) {
    int n_dev = 0;
    if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev == 0) {
        std::printf("%s\n", json{{"gpu", false}, {"reason", "no CUDA device visible"}}.dump().c_str());
        return 77;
    }
    const double seconds_per_point = argc > 1 ? std::atof(argv[1]) : 0.3;
    try {
        json           out;
        cudaDeviceProp prop{};
        ck(cudaGetDeviceProperties(&prop, 0), "props");
        out["device"] = prop.name;
        std::mt19937 rng(1);

        // Reference: device memcpy, 1 GiB.
        const size_t cp = size_t{1} << 30;
        void *       src = nullptr, * dst = nullptr;
        ck(cudaMalloc(&src, cp), "malloc");
        ck(cudaMalloc(&dst, cp), "malloc");
        ck(cudaMemset(src, 1, cp), "memset");
        const double t_cp  = time_s([&] { ck(cudaMemcpyAsync(dst, src, cp, cudaMemcpyDeviceToDevice, nullptr), "memcpy"); }, 20);
        const double bw_rw = 2.0 * cp / t_cp;
        out["memcpy"] = {{"bytes", cp}, {"seconds", t_cp}, {"rw_bytes_per_s", bw_rw}};
        cudaFree(src);
        cudaFree(dst);

        // One decoder layer's linears, BF16 weights.
        struct Lin { const char * name; int64_t n_out, n_in; };
        const std::vector<Lin> lins = {{"q", 2048, 2048}, {"k", 512, 2048}, {"v", 512, 2048}, {"o", 2048, 2048},
                                       {"gate", 8192, 2048}, {"up", 8192, 2048}, {"down", 2048, 8192}};
        std::vector<uint16_t *> w;
        double                  w_bytes = 0, flop_per_row = 0;
        for (const Lin & l : lins) {
            w.push_back(dev_random<uint16_t>(static_cast<size_t>(l.n_out * l.n_in), rng));
            w_bytes += 2.0 * l.n_out * l.n_in;
            flop_per_row += 2.0 * l.n_out * l.n_in;
        }
        const int64_t b_max = 256;
        float *       x   = dev_random<float>(static_cast<size_t>(b_max * 8192), rng);
        uint16_t *    xb  = dev_random<uint16_t>(static_cast<size_t>(b_max * 8192), rng);
        float *       y   = nullptr;
        ck(cudaMalloc(reinterpret_cast<void **>(&y), sizeof(float) * b_max * 8192), "malloc");
        cublasHandle_t h;
        ckb(cublasCreate(&h), "cublasCreate");
        json lin = json::array();
        for (const int64_t b : {int64_t{1}, int64_t{64}, int64_t{256}}) {
            auto ours = [&] {
                for (size_t i = 0; i < lins.size(); ++i) {
                    KC::linear(y, x, w[i], fd::kernels::WType::bf16, nullptr, b, lins[i].n_out, lins[i].n_in, nullptr);
                }
            };
            auto cublas = [&] {  // column-major: Y^T [n_out, b] = W [n_out, n_in] (row-major = W^T col-major) · X^T
                const float one = 1.0f, zero = 0.0f;
                for (size_t i = 0; i < lins.size(); ++i) {
                    ckb(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(lins[i].n_out), static_cast<int>(b),
                                     static_cast<int>(lins[i].n_in), &one, w[i], CUDA_R_16BF, static_cast<int>(lins[i].n_in),
                                     xb, CUDA_R_16BF, static_cast<int>(lins[i].n_in), &zero, y, CUDA_R_32F,
                                     static_cast<int>(lins[i].n_out), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                        "cublasGemmEx");
                }
            };
            const double t1   = time_s(ours, 3);
            const int    reps = std::max(3, static_cast<int>(seconds_per_point / std::max(t1, 1e-6)));
            const double t    = time_s(ours, reps);
            const double tc   = time_s(cublas, reps);
            lin.push_back({{"batch", b}, {"seconds", t}, {"weight_bytes_per_s", w_bytes / t},
                           {"weight_bw_over_memcpy", w_bytes / t / bw_rw}, {"tflops", flop_per_row * b / t / 1e12},
                           {"cublas_bf16_seconds", tc}, {"cublas_over_ours_time", tc / t}});
        }
        out["linear"] = {{"layer", "hidden 2048, q 2048, kv 2x512, o 2048, gate/up 8192, down 2048x8192, bf16"},
                         {"weight_bytes", w_bytes}, {"points", lin}};
        cublasDestroy(h);
        for (auto * p : w) { cudaFree(p); }
        cudaFree(x);
        cudaFree(xb);
        cudaFree(y);

        // Sleep / wakeup of the virtual-memory allocator: 8 GiB of kv_cache, 2 GiB of weights.
        {
            using fd::memory::Tag;
            auto alloc = fd::memory::make_cuda_vmm_allocator(0);
            alloc->map(Tag::kv_cache, int64_t{8} << 30, true);
            alloc->map(Tag::weight, int64_t{2} << 30, true);
            const size_t held  = free_bytes();
            const auto   t0    = std::chrono::steady_clock::now();
            const size_t freed = static_cast<size_t>(alloc->release(Tag::kv_cache) + alloc->release(Tag::weight));
            const auto   t1    = std::chrono::steady_clock::now();
            const size_t after = free_bytes();
            alloc->reacquire(Tag::weight, true);
            alloc->reacquire(Tag::kv_cache, true);
            const auto t2 = std::chrono::steady_clock::now();
            out["vmm"] = {{"bytes", freed}, {"sleep_seconds", std::chrono::duration<double>(t1 - t0).count()},
                          {"wakeup_seconds", std::chrono::duration<double>(t2 - t1).count()},
                          {"freed_fraction", static_cast<double>(after - held) / static_cast<double>(freed)}};
        }
        if (argc > 2) { out["decode"] = fd::bench::decode_bench(argv[2], bw_rw, seconds_per_point); }
        out["gpu"] = true;
        std::printf("%s\n", out.dump(2).c_str());
        return 0;
    } catch (const std::exception & e) {
        std::printf("%s\n", json{{"gpu", true}, {"error", e.what()}}.dump().c_str());
        return 1;
    }
}
