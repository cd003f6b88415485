"""scripts/rl_loop.sh end to end: a real rsync --daemon, fdrollout --load-strategy rsync on
stories260K, 5 rounds of rollout → pause → trainer step → fdctl publish → update-weights
--verify-checksum → resume, each checked against a fresh daemon on the published checkpoint."""
import os
import re
import subprocess
import unittest

from fdtest import BIN, FDCTL, PYTHON, REPO


class RlLoop(unittest.TestCase):
    def test_five_rounds(self):
        p = subprocess.run([os.path.join(REPO, "scripts", "rl_loop.sh"), "--rounds", "5"], capture_output=True, text=True,
                           timeout=120, env={**os.environ, "FDROLLOUT_BIN": BIN, "FDCTL_BIN": FDCTL, "FD_PYTHON": PYTHON})
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        rounds = re.findall(r"^round (\d+): served (\d+), published and loaded version (\d+) with checksums in ([0-9.]+) s",
                            p.stdout, re.M)
        self.assertEqual([(int(r[0]), int(r[1]), int(r[2])) for r in rounds], [(n, n - 1, n) for n in range(1, 6)], p.stdout)
        self.assertTrue(all(float(r[3]) > 0 for r in rounds))
        self.assertIn("rl_loop: 5 rounds OK", p.stdout)


if __name__ == "__main__":
    unittest.main()
