"""The cost of the version-label fingerprint against a full SHA-256 of the weights (issue 26,
docs/weight_sources.md "The version label names the bytes served"), both timed in the same run on
the same file, from the page cache.

  /usr/bin/python3 tests/bench/fingerprint_bench.py [MiB]   (default 512; the file is removed after)

The fingerprint side mirrors daemon/src/weights/fingerprint.cpp per file: stat (size, mtime ns),
read the 8-byte length and the JSON header, SHA-256 of those. Prints both times and their ratio.
"""
import hashlib
import json
import os
import struct
import sys
import tempfile
import time


def main():
    mib = int(sys.argv[1]) if len(sys.argv) > 1 else 512
    n = (mib << 20) // 4
    fd, path = tempfile.mkstemp(prefix="fd-fp-bench-", suffix=".safetensors")
    try:
        hdr = json.dumps({"w": {"dtype": "F32", "shape": [n], "data_offsets": [0, n * 4]}}).encode()
        hdr += b" " * (-len(hdr) % 8)
        with os.fdopen(fd, "wb") as f:
            f.write(struct.pack("<Q", len(hdr)) + hdr)
            chunk = os.urandom(1 << 20)
            for _ in range(mib):
                f.write(chunk)

        def fingerprint():
            st = os.stat(path)
            with open(path, "rb") as f:
                h = f.read(struct.unpack("<Q", f.read(8))[0])
            return hashlib.sha256(f"{os.path.basename(path)}\n{st.st_size}\n{st.st_mtime_ns}\n".encode() + h).hexdigest()

        def full():
            h = hashlib.sha256()
            with open(path, "rb") as f:
                while b := f.read(1 << 20):
                    h.update(b)
            return h.hexdigest()

        full()  # the page cache holds the file: both read from memory
        t0 = time.perf_counter()
        for _ in range(1000):
            fingerprint()
        t_fp = (time.perf_counter() - t0) / 1000
        t0 = time.perf_counter()
        for _ in range(3):
            full()
        t_full = (time.perf_counter() - t0) / 3
        print(json.dumps({"mib": mib, "fingerprint_us": round(t_fp * 1e6, 1), "full_sha256_s": round(t_full, 3),
                          "full_sha256_gb_per_s": round((mib << 20) / t_full / 1e9, 3), "ratio_full_over_fingerprint": round(t_full / t_fp)}))
    finally:
        os.unlink(path)


if __name__ == "__main__":
    main()
