"""A trainer killed mid-stream, run by tests/python/test_weight_stream.py (killed_trainer).
Mode "mid": announces every tensor as one bucket, sends half the frames and
a few bytes of the next, says SENT, waits. mode "between": one whole bucket of 3 tensors, answered,
then SENT (the update stays open between calls). mode "unannounced": writes every tensor's frame
without any /update_weights call (so nothing on the daemon reads them), then SENT.

Usage: killed_trainer.py PORT PYTHON_PACKAGE_DIR CHECKPOINT_FILE MODE
"""
import json, socket, struct, sys, threading, time, http.client
sys.path.insert(0, sys.argv[2])
from fdrollout import safetensors_np
port, ckpt, mode = int(sys.argv[1]), sys.argv[3], sys.argv[4]
def post(path, body):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    c.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = c.getresponse(); return r.status, json.loads(r.read() or b"null")
_, info = post("/init_weight_transfer_engine", {"init_info": {"backend": "tcp"}})
s = socket.create_connection(("127.0.0.1", info["port"]))
def frame(h, n=0):
    h = json.dumps(h).encode(); return b"FDW1" + struct.pack("<I", len(h)) + h
s.sendall(frame({"token": info["token"]}))
post("/start_weight_update", {"version": "killed"})
t = safetensors_np.load_file(ckpt)
names = sorted(t)
if mode == "between":
    names = names[:3]
ui = {"names": names, "dtype_names": ["F32"] * len(names), "shapes": [list(t[n].shape) for n in names]}
if mode == "unannounced":  # every frame written, no /update_weights call made: the bytes fill the
    def send_all():        # daemon's receive window and the rest waits in our send buffer
        for n in names:
            s.sendall(frame({"name": n, "dtype": "F32", "shape": list(t[n].shape), "nbytes": t[n].nbytes}) + t[n].tobytes())
    threading.Thread(target=send_all, daemon=True).start()
    time.sleep(0.5)
    print("SENT", flush=True)
    time.sleep(600)
th = threading.Thread(target=post, args=("/update_weights", {"update_info": ui}), daemon=True)
th.start()
for n in names[: len(names) // 2] if mode == "mid" else names:
    a = t[n]
    s.sendall(frame({"name": n, "dtype": "F32", "shape": list(a.shape), "nbytes": a.nbytes}))
    s.sendall(a.tobytes())
if mode == "mid":
    n = names[len(names) // 2]
    s.sendall(frame({"name": n, "dtype": "F32", "shape": list(t[n].shape), "nbytes": 4 * t[n].size}))
    s.sendall(b"\0" * 12)  # a few bytes of the next tensor's data
else:
    th.join()
print("SENT", flush=True)
time.sleep(600)
