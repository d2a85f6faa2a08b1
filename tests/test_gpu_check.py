"""bench/gpu_check.sh, the one command for a lent GPU, runs end to end on CPU in its dry mode
and says which steps it skipped."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(__file__))


def test_gpu_check_dry_run(tmp_path):
    out = tmp_path / "check.md"
    env = dict(os.environ, PYTHON=sys.executable, TIERTRAIN=os.path.join(os.path.dirname(sys.executable), "tiertrain"))
    r = subprocess.run(["bash", os.path.join(ROOT, "bench", "gpu_check.sh"), "--dry", "--out", str(out),
                        "--nvme", str(tmp_path / "nvme")], capture_output=True, text=True, timeout=600, env=env)
    text = out.read_text()
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:] + text[-3000:]
    assert "(dry run, no GPU)" in text
    lines = text.splitlines()
    for step in ("under the CUDA sanitizer, host-resident", "under the CUDA sanitizer, every block",
                 "device memory over 20 steps", "host synchronisations per step", "Llama step with states on the NVMe",
                 "GPUDirect Storage: default model with --io.gds=on", "tiertrain vs DeepSpeed ZeRO-Infinity, cuda"):
        assert any(step in ln and ln.endswith("**: skipped (dry run: needs CUDA)") for ln in lines), step
    assert "**GPU tests (pytest -m gpu)**: exit 0" in text and "skipped" in text
    assert "**default job on CPU, 3 steps (dry run)**: exit 0" in text
    assert "0 step(s) failed" in text
    assert not (tmp_path / "nvme").exists()
