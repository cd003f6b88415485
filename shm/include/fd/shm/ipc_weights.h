// fd/shm/ipc_weights.h — the `ipc` weight record: how a trainer hands live tensors to a
// rollout on the same host (SPEC §5; docs/weight_sources.md). Shared by fdrollout (reader),
// fdctl publish --strategy ipc and scripts/fdpublish.py (writers); the Python writer mirrors
// these offsets with struct.pack, so any change here bumps kIpcAbiVersion.
//
// One POSIX shm object per rank: /fdrollout.<port>.weights.tp<rank> (file /dev/shm/...), mode
// 0600, laid out as
//   [IpcRecordHeader][IpcTensorEntry x n_tensors][pad to 4096][tensor data ...]
// Entry offsets are bytes from the start of the object, 64-byte aligned. Little-endian.
//
// Publishing protocol (a half-written publish is never consumed):
//   writer: generation := odd (g+1), write entries and data, then generation := g+2 (even),
//           release ordering; a new object starts at generation 0 (nothing published yet).
//   reader: g1 := generation (acquire); odd or 0 → not ready (503 source_unavailable); copy
//           every tensor into its own memory; g2 := generation; g1 != g2 → the publisher wrote
//           during the copy, drop the copy (503, retry). The rollout always copies, so the
//           trainer may reuse or free its memory once the update returned.
// location kIpcCudaIpc: data lives in GPU memory of the writer; `cuda_ipc_handle` is the
// cudaIpcMemHandle_t of its allocation and `offset` the byte offset inside it. Only CUDA builds
// read such entries; a CPU build answers 503 naming the tensor.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

namespace fd::shm {

inline constexpr uint64_t kIpcMagic      = 0x5043494457524446ULL;  // "FDRWDICP" little-endian
inline constexpr uint32_t kIpcAbiVersion = 1;
inline constexpr int      kIpcNameCap    = 192;
inline constexpr int      kIpcMaxDims    = 4;
inline constexpr int64_t  kIpcDataAlign  = 4096;  ///< first tensor's data offset alignment

enum IpcDType : uint32_t { kIpcF32 = 0, kIpcBF16 = 1, kIpcF16 = 2 };
enum IpcLocation : uint32_t { kIpcInline = 0, kIpcCudaIpc = 1 };

struct IpcRecordHeader {
    uint64_t              magic;            ///< kIpcMagic
    uint32_t              abi_version;      ///< kIpcAbiVersion
    uint32_t              n_tensors;
    std::atomic<uint64_t> generation;       ///< seqlock: odd = being written, 0 = never published
    char                  version[136];     ///< weight version, NUL-terminated ([A-Za-z0-9._-]{1,128})
    int32_t               rank;
    int32_t               tp_size;
    uint64_t              total_bytes;      ///< size of the whole object
    uint64_t              data_bytes;       ///< sum of the tensors' nbytes
    uint8_t               reserved[72];
};
static_assert(sizeof(IpcRecordHeader) == 256, "IpcRecordHeader is part of the ABI");

struct IpcTensorEntry {
    char     name[kIpcNameCap];  ///< inference or HF name, NUL-terminated
    uint32_t dtype;              ///< IpcDType
    uint32_t location;           ///< IpcLocation
    uint32_t ndim;
    uint32_t reserved0;
    int64_t  shape[kIpcMaxDims]; ///< outermost first; unused dims 0
    uint64_t offset;             ///< kIpcInline: bytes from the object start; kIpcCudaIpc: into the allocation
    uint64_t nbytes;
    uint8_t  cuda_ipc_handle[64];///< cudaIpcMemHandle_t when location == kIpcCudaIpc
};
static_assert(sizeof(IpcTensorEntry) == 192 + 16 + 32 + 16 + 64, "IpcTensorEntry is part of the ABI");

/// "/fdrollout.<port>.weights.tp<rank>" (shm_open name; the file is /dev/shm/ without the '/').
inline std::string ipc_weights_name(int port, int rank) {
    return "/fdrollout." + std::to_string(port) + ".weights.tp" + std::to_string(rank);
}

// ---------------------------------------------------------------------------------------------
// The ipc DELTA record (docs/weight_streams.md, "Over ipc publishes"): one shm object per port,
// /fdrollout.<port>.weights.delta (file /dev/shm/...), mode 0600, holding a sparse update in HF
// (training) names against the version the rollout serves:
//   [IpcDeltaHeader (512 B)][payload: the bytes of a weights.fddelta file, fd/weights/weight_delta.h]
// total_bytes is a multiple of 4096. Same seqlock as the weights record (generation odd while
// written, even when complete, 0 never published); the rollout copies the payload into its
// private staging dir and checks the generation again after the copy. Written by
// fdrollout.publish.publish_ipc_delta (Python, struct.pack mirrors this layout).
inline constexpr uint64_t kIpcDeltaMagic      = 0x314C444350494446ULL;  // "FDIPCDL1" little-endian
inline constexpr uint32_t kIpcDeltaAbiVersion = 1;
inline constexpr int64_t  kIpcDeltaPayload    = 512;  ///< payload offset

struct IpcDeltaHeader {
    uint64_t              magic;            ///< kIpcDeltaMagic
    uint32_t              abi_version;      ///< kIpcDeltaAbiVersion
    uint32_t              reserved0;
    std::atomic<uint64_t> generation;       ///< seqlock, as IpcRecordHeader::generation (same offset, 16)
    uint64_t              payload_bytes;    ///< bytes of the weights.fddelta payload at kIpcDeltaPayload
    uint64_t              total_bytes;      ///< size of the whole object (>= kIpcDeltaPayload + payload_bytes)
    char                  version[136];     ///< the version this delta makes, NUL-terminated ([A-Za-z0-9._-]{1,128})
    char                  base_version[136];///< the version it applies to (the rollout must serve exactly it)
    uint8_t               reserved[200];
};
static_assert(sizeof(IpcDeltaHeader) == kIpcDeltaPayload, "IpcDeltaHeader is part of the ABI");

/// "/fdrollout.<port>.weights.delta" (shm_open name; the file is /dev/shm/ without the '/').
inline std::string ipc_delta_name(int port) { return "/fdrollout." + std::to_string(port) + ".weights.delta"; }

}  // namespace fd::shm
