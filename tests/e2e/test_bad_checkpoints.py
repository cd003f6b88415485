"""A bad checkpoint never hangs the daemon and never gets in (issue 12, defects 3, 5, 8): a FIFO or
/dev/zero as model.safetensors, data_offsets that overlap, leave a hole or overflow, NaN/Inf
weights — refused at start-up (exit 5 naming the file and tensor) and at update_weights (422
invalid_checkpoint naming them, at once, and the previous weights keep serving bit-exactly).
A Hugging Face cache layout (snapshot files are symlinks into blobs/) keeps working, and a tied
model that also stores a different lm_head.weight is served (the head ignored) with a warning."""
import json
import os
import shutil
import struct
import subprocess
import tempfile
import time
import unittest

import numpy as np

from fdtest import BIN, REF, STORIES, Daemon, copy_checkpoint, free_port, greedy, perturbed

import safetensors_np  # noqa: E402  (on sys.path via fdtest)

EXIT_INVALID_CHECKPOINT = 5


def read_raw(path):
    """(header dict without __metadata__, data bytes) of a safetensors file."""
    header, base = safetensors_np.read_header(path)
    header.pop("__metadata__", None)
    with open(path, "rb") as f:
        f.seek(base)
        return header, f.read()


def write_raw(path, header, data):
    """Write a safetensors file with exactly this header (no checks) and data."""
    h = json.dumps(header).encode()
    h += b" " * (-(8 + len(h)) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + data)
    os.replace(tmp, path)


def start_fails(model, timeout=30):
    """Start fdrollout on `model`; it must exit (not hang). Returns (exit code, stderr+stdout)."""
    p = subprocess.run([BIN, "--model", model, "--port", str(free_port())], capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout + p.stderr


class BadCheckpoints(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="fd-badckpt-")
        cls.A = copy_checkpoint(STORIES, os.path.join(cls.tmp, "A"))
        cls.B = perturbed(STORIES, os.path.join(cls.tmp, "B"), seed=5)
        header, _ = read_raw(os.path.join(STORIES, "model.safetensors"))
        cls.names = sorted(header)
        # Two tensors of the same size (a layer's q_proj and the next layer's) for the overlap case.
        cls.q0, cls.q1 = "model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.weight"
        assert cls.q0 in header and cls.q1 in header, cls.names
        cls.cols = header[cls.q1]["shape"][1]

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def variant(self, name, edit):
        """A copy of A whose model.safetensors `edit(path)` broke."""
        d = os.path.join(self.tmp, name)
        shutil.rmtree(d, ignore_errors=True)
        copy_checkpoint(self.A, d)
        edit(os.path.join(d, "model.safetensors"))
        return d

    # ---- the corpus: name → (edit of model.safetensors, words the error must contain) ----

    def corpus(self):
        q0, q1 = self.q0, self.q1

        def fifo(p):
            os.unlink(p)
            os.mkfifo(p)

        def devzero(p):
            os.unlink(p)
            os.symlink("/dev/zero", p)

        def loop(p):  # a probe: the status call's throw was a 500 "filesystem error"
            os.unlink(p)
            os.symlink(os.path.basename(p), p)

        def overlap(p):
            h, data = read_raw(p)
            h[q1]["data_offsets"] = list(h[q0]["data_offsets"])  # q1 reads q0's bytes; q1's own bytes are orphaned
            write_raw(p, h, data)

        def gap(p):
            h, data = read_raw(p)
            begin = h[q1]["data_offsets"][0]
            for v in h.values():  # 64 unindexed bytes before q1
                if v["data_offsets"][0] >= begin:
                    v["data_offsets"] = [v["data_offsets"][0] + 64, v["data_offsets"][1] + 64]
            write_raw(p, h, data[:begin] + b"\0" * 64 + data[begin:])

        def not_from_zero(p):
            h, data = read_raw(p)
            for v in h.values():
                v["data_offsets"] = [v["data_offsets"][0] + 8, v["data_offsets"][1] + 8]
            write_raw(p, h, b"\0" * 8 + data)

        def trailing(p):
            h, data = read_raw(p)
            write_raw(p, h, data + b"\0" * 16)

        def overflow(p):
            h, data = read_raw(p)
            h[q1]["shape"] = [2 ** 40, 2 ** 30]  # 2^70 elements x 4 bytes
            write_raw(p, h, data)

        def past_end(p):
            h, data = read_raw(p)
            last = max(h, key=lambda k: h[k]["data_offsets"][1])
            write_raw(p, h, data[:-4])
            return last

        def nan(p):
            t = safetensors_np.load_file(p)
            t[q1] = t[q1].copy()
            t[q1][3, 5] = np.nan
            safetensors_np.save_file(t, p)

        def inf(p):
            t = safetensors_np.load_file(p)
            t["model.norm.weight"] = t["model.norm.weight"].copy()
            t["model.norm.weight"][7] = -np.inf
            safetensors_np.save_file(t, p)

        return {
            "fifo": (fifo, ["model.safetensors", "FIFO"]),
            "dev_zero": (devzero, ["model.safetensors", "character device"]),
            "symlink_loop": (loop, ["model.safetensors", "symbolic links"]),
            "overlap": (overlap, ["model.safetensors", q1, "overlaps"]),
            "gap": (gap, ["model.safetensors", q1, "hole"]),
            "not_from_zero": (not_from_zero, ["model.safetensors", "hole"]),
            "trailing": (trailing, ["model.safetensors", "trailing"]),
            "overflow": (overflow, ["model.safetensors", q1, "overflows"]),
            "past_end": (past_end, ["model.safetensors", "outside"]),
            "nan": (nan, ["model.safetensors", q1, "non-finite", f"element {3 * self.cols + 5}"]),  # row 3, col 5
            "inf": (inf, ["model.safetensors", "model.norm.weight", "non-finite", "element 7"]),
        }

    def test_start_up_refuses_each_bad_checkpoint_at_once_naming_it(self):
        for name, (edit, words) in self.corpus().items():
            with self.subTest(name):
                d = self.variant("start-" + name, edit)
                t0 = time.time()
                rc, out = start_fails(d)
                self.assertLess(time.time() - t0, 20, out)
                self.assertEqual(rc, EXIT_INVALID_CHECKPOINT, out)
                for w in words:
                    self.assertIn(w, out)

    def test_update_weights_refuses_each_bad_checkpoint_and_the_old_weights_keep_serving(self):
        model = copy_checkpoint(self.A, os.path.join(self.tmp, "live"))
        good = os.path.join(model, "model.safetensors.good")
        shutil.copyfile(os.path.join(model, "model.safetensors"), good)
        with Daemon("--dynamic-load-weight", model=model) as d:
            before = greedy(d)
            for name, (edit, words) in self.corpus().items():
                with self.subTest(name):
                    self.assertEqual(d.post("/v1/pause")[0], 200)
                    p = os.path.join(model, "model.safetensors")
                    shutil.copyfile(good, p + ".x")
                    os.replace(p + ".x", p)
                    edit(p)
                    t0 = time.time()
                    status, j = d.post("/v1/update_weights", {"version": "bad-" + name.replace("_", "-")}, timeout=30)
                    self.assertLess(time.time() - t0, 10, j)
                    self.assertEqual((status, j["error"]["type"]), (422, "invalid_checkpoint"), j)
                    for w in words:
                        self.assertIn(w, j["error"]["message"])
                    self.assertEqual(d.post("/v1/resume")[0], 200)
                    self.assertEqual(greedy(d), before)  # ids, logprobs and version "0", bit-exact
            # The good file again: the update goes through (the refusals above were not blanket).
            d.post("/v1/pause")
            os.unlink(os.path.join(model, "model.safetensors"))
            shutil.copyfile(os.path.join(self.B, "model.safetensors"), os.path.join(model, "model.safetensors"))
            status, j = d.post("/v1/update_weights", {"version": "b"})
            self.assertEqual(status, 200, j)
            d.post("/v1/resume")
            self.assertEqual(greedy(d)[2], "b")

    def test_tp2_a_nan_in_the_second_rank_s_columns_is_refused_naming_its_hf_element(self):
        # o_proj and down_proj are split by columns at tp=2: rank 1 reads columns [cols/2, cols)
        # of every row (a block of rows per preadv), and must find a NaN there itself, naming the
        # element as the checkpoint numbers it (row * cols + col), at start-up and at an update.
        name = "model.layers.2.mlp.down_proj.weight"
        rows, cols = read_raw(os.path.join(STORIES, "model.safetensors"))[0][name]["shape"]
        r, c = rows - 3, cols - 2  # in rank 1's half, past the first row block

        def nan(p):
            t = safetensors_np.load_file(p)
            t[name] = t[name].copy()
            t[name][r, c] = np.nan
            safetensors_np.save_file(t, p)

        words = [name, "non-finite", f"element {r * cols + c}"]
        tp2 = ["--tensor-parallel-size", "2", "--threads", "1"]
        d = self.variant("tp2-nan", nan)
        p = subprocess.run([BIN, "--model", d, "--port", str(free_port()), *tp2], capture_output=True, text=True, timeout=60)
        self.assertEqual(p.returncode, EXIT_INVALID_CHECKPOINT, p.stdout + p.stderr)
        for w in words:
            self.assertIn(w, p.stdout + p.stderr)
        model = copy_checkpoint(self.A, os.path.join(self.tmp, "live-tp2"))
        with Daemon("--dynamic-load-weight", *tp2, model=model) as dm:
            before = greedy(dm)
            self.assertEqual(dm.post("/v1/pause")[0], 200)
            shutil.copyfile(os.path.join(d, "model.safetensors"), os.path.join(model, "model.safetensors.x"))
            os.replace(os.path.join(model, "model.safetensors.x"), os.path.join(model, "model.safetensors"))
            status, j = dm.post("/v1/update_weights", {"version": "bad-tp2"}, timeout=30)
            self.assertEqual((status, j["error"]["type"]), (422, "invalid_checkpoint"), j)
            for w in words:
                self.assertIn(w, j["error"]["message"])
            self.assertEqual(dm.post("/v1/resume")[0], 200)
            self.assertEqual(greedy(dm), before)  # both ranks still serve the old weights, bit-exact

    def test_nan_check_can_be_switched_off(self):
        d = self.variant("nan-off", self.corpus()["nan"][0])
        with Daemon("--no-check-finite-weights", model=d) as dm:
            self.assertEqual(dm.get("/health")[0], 200)

    def test_a_hugging_face_cache_layout_of_symlinks_into_blobs_is_served(self):
        # models--x/blobs/<name>, models--x/snapshots/rev/<file> -> ../../blobs/<name> (relative, as HF writes)
        root = os.path.join(self.tmp, "hub", "models--stories")
        blobs, snap = os.path.join(root, "blobs"), os.path.join(root, "snapshots", "0123abc")
        os.makedirs(blobs, exist_ok=True)
        os.makedirs(snap, exist_ok=True)
        for i, name in enumerate(sorted(os.listdir(STORIES))):
            src = os.path.join(STORIES, name)
            if os.path.isfile(src):
                shutil.copyfile(src, os.path.join(blobs, f"blob{i}"))
                os.symlink(os.path.join("..", "..", "blobs", f"blob{i}"), os.path.join(snap, name))
        self.assertTrue(os.path.islink(os.path.join(snap, "model.safetensors")))
        with Daemon("--dynamic-load-weight", model=snap) as d:
            j = d.complete(prompt="Once upon a time", max_tokens=60, temperature=0)
            self.assertEqual(j["choices"][0]["token_ids"], REF["Once upon a time"]["ids"])
            d.post("/v1/pause")
            status, j = d.post("/v1/update_weights", {"version": "same"})
            self.assertEqual(status, 200, j)

    def test_a_tied_model_with_a_different_stored_lm_head_warns_naming_it(self):
        def add_head(p):
            t = safetensors_np.load_file(p)
            t["lm_head.weight"] = t["model.embed_tokens.weight"] * 0.5
            safetensors_np.save_file(t, p)

        d = self.variant("tied-head", add_head)
        with Daemon(model=d) as dm:
            j = dm.complete(prompt="Once upon a time", max_tokens=60, temperature=0)
            self.assertEqual(j["choices"][0]["token_ids"], REF["Once upon a time"]["ids"])  # the stored head is ignored
            out = dm.output()
        self.assertIn("lm_head.weight", out)
        self.assertIn("differs", out)

        def same_head(p):
            t = safetensors_np.load_file(p)
            t["lm_head.weight"] = t["model.embed_tokens.weight"]
            safetensors_np.save_file(t, p)

        with Daemon(model=self.variant("tied-same", same_head)) as dm:
            self.assertNotIn("differs", dm.output())


if __name__ == "__main__":
    unittest.main()
