"""The soak's short form: benchmarks/serve_soak.py against a real ``kvjax serve`` of
``random:tiny`` for 20 seconds of mixed traffic (chats, contexts made, asked and deleted, cancelled
streams, bad requests); every answer equal to its reference, memory and open files flat, the store
within its limit, a clean SIGTERM. The long form's figures are in docs/serving.md."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_a_short_soak_passes_every_check(tmp_path):
    out = tmp_path / "soak.json"
    cmd = [sys.executable, "benchmarks/serve_soak.py", "--model", "random:tiny"]
    cmd += ["--seconds", "20", "--clients", "6", "--sample", "2", "--timeout", "120"]
    # about two of the four documents' contexts (60-70 KB each) fit: the limit is reached
    cmd += ["--context-memory-mb", "0.15", "--out", str(out)]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["passed"] and all(report["checks"].values()), report["checks"]
    kinds = report["requests"]
    assert set(kinds) >= {"chat", "context question streamed", "context deleted", "bad request"}
    assert sum(kinds.values()) >= 100 and report["errors"] == {}
    # the store's limit was reached: contexts moved out of memory and were read back from disk
    last = report["samples"][-1]
    assert last["store_memory_limit"] == int(0.15 * 2**20)
    assert max(s["store_memory_bytes"] for s in report["samples"]) > last["store_memory_limit"] / 3
    assert last["store_loads_from_disk"] > 0
