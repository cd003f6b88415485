// fd/dtype.h: the one dtype enum. Its names are safetensors' (the format's README lists "F32",
// "BF16", "F16"), its parser also reads what PyTorch prints for a tensor's dtype (`str(t.dtype)`
// in torch 1.13: "torch.float32", "torch.bfloat16", "torch.float16"; `torch.float` and
// `torch.half` are the same objects), sizes are torch's `element_size()`, and its numbering is
// the shm IPC snapshot's (fd/shm/ipc_weights.h), which fdctl writes and the ipc source reads.
#include "fd/checkpoint/safetensors.h"
#include "fd/dtype.h"
#include "fd/kernels/backend.h"
#include "fd/kernels/ops.h"
#include "fd/shm/ipc_weights.h"

#include <doctest/doctest.h>

#include <string>
#include <type_traits>

TEST_CASE("dtype: names, sizes and numbering match safetensors, torch and the IPC snapshot") {
    // torch 1.13: torch.empty(1, dtype=d).element_size() -> 4, 2, 2.
    CHECK(fd::dtype_size(fd::DType::f32) == 4);
    CHECK(fd::dtype_size(fd::DType::bf16) == 2);
    CHECK(fd::dtype_size(fd::DType::f16) == 2);
    CHECK(std::string(fd::dtype_name(fd::DType::f32)) == "F32");
    CHECK(std::string(fd::dtype_name(fd::DType::bf16)) == "BF16");
    CHECK(std::string(fd::dtype_name(fd::DType::f16)) == "F16");
    // The IPC snapshot's dtype field carries the same numbers.
    CHECK(static_cast<uint32_t>(fd::DType::f32) == fd::shm::kIpcF32);
    CHECK(static_cast<uint32_t>(fd::DType::bf16) == fd::shm::kIpcBF16);
    CHECK(static_cast<uint32_t>(fd::DType::f16) == fd::shm::kIpcF16);
}

TEST_CASE("dtype: parse reads safetensors' and torch's spellings, refuses anything else") {
    CHECK(fd::parse_dtype("F32") == fd::DType::f32);
    CHECK(fd::parse_dtype("BF16") == fd::DType::bf16);
    CHECK(fd::parse_dtype("F16") == fd::DType::f16);
    CHECK(fd::parse_dtype("torch.float32") == fd::DType::f32);
    CHECK(fd::parse_dtype("torch.bfloat16") == fd::DType::bf16);
    CHECK(fd::parse_dtype("torch.float16") == fd::DType::f16);
    CHECK(fd::parse_dtype("float") == fd::DType::f32);
    CHECK(fd::parse_dtype("half") == fd::DType::f16);
    for (fd::DType d : {fd::DType::f32, fd::DType::bf16, fd::DType::f16}) { CHECK(fd::parse_dtype(fd::dtype_name(d)) == d); }
    // Not dtypes this engine stores (safetensors also has F64, I64, U8, F8_E4M3, ...).
    for (const char * bad : {"", "f32", "F64", "I64", "torch.int64", "torch.", "bf16", "float64", "torch.torch.float32"}) {
        CAPTURE(bad);
        CHECK_FALSE(fd::parse_dtype(bad).has_value());
    }
}

TEST_CASE("dtype: the three pre-#22 enums are aliases of fd::DType") {
    static_assert(std::is_same_v<fd::model::DType, fd::DType>);
    static_assert(std::is_same_v<fd::kernels::WType, fd::DType>);
    static_assert(std::is_same_v<fd::kernels::StoredType, fd::DType>);
    static_assert(fd::dtype_size(fd::DType::bf16) == 2);  // usable at compile time
    CHECK(fd::model::dtype_size(fd::model::DType::bf16) == 2);
}
