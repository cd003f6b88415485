"""The loopback baselines' receiver (stream_bench.py, land_once_probe.py): another process, as the
daemon or a rank is. Run as `python3 -c RECEIVER TOTAL MODE [REPS]`: it prints its port, then
serves REPS connections (default 1), each of TOTAL bytes, into the same buffer, and answers each
with the count received. MODE "discard" is iperf-style: it recv_intos one reused 256 KiB buffer
(iperf3 reads into one 128 KiB buffer), the transport's own ceiling, which issue 25's target
names. MODE "land": every byte lands in one buffer of the whole size, allocated and touched
before the sender starts (no page faults timed): TCP plus one write of each byte to memory, the
least a receiver that keeps the bytes must do. Its accept and each receive time out after 120 s."""

RECEIVER = r"""
import socket, sys
total, mode = int(sys.argv[1]), sys.argv[2]
reps = int(sys.argv[3]) if len(sys.argv) > 3 else 1
piece = 256 << 10
buf = bytearray(b"\x01" * (piece if mode == "discard" else total))
mv = memoryview(buf)
srv = socket.create_server(("127.0.0.1", 0))
srv.settimeout(120)  # every wait bounded: a sender that never comes or stalls ends this process
print(srv.getsockname()[1], flush=True)
for _ in range(reps):
    c, _ = srv.accept()
    c.settimeout(120)
    n = 0
    while n < total:
        k = c.recv_into(mv if mode == "discard" else mv[n:], min(total - n, piece if mode == "discard" else 8 << 20))
        if k == 0:
            break
        n += k
    c.sendall(str(n).encode())
    c.close()
"""
