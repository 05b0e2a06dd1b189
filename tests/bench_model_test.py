"""bench/make_bench_lm.py writes a model moh-generate loads and that always
generates exactly the tokens asked for (its end-of-sequence token never wins).

Environment (CTest sets them): MOH_GENERATE (path of moh-generate),
MOH_SOURCE_DIR (the repository). Run with /usr/bin/python3 -m pytest.
"""
import json
import os
import re
import subprocess
import sys

GENERATE = os.environ.get("MOH_GENERATE", "")
SOURCE = os.environ.get("MOH_SOURCE_DIR", "")


def test_bench_model_generates_every_token(tmp_path):
    assert os.access(GENERATE, os.X_OK), "MOH_GENERATE=%r" % GENERATE
    out = tmp_path / "bench-lm"
    subprocess.run([sys.executable, os.path.join(SOURCE, "bench",
                                                 "make_bench_lm.py"),
                    "--out=%s" % out], check=True, timeout=120)
    with open(out / "config.json") as f:
        config = json.load(f)
    assert config["hidden_size"] == 512 and config["num_hidden_layers"] == 8
    result = subprocess.run(
        [GENERATE, "--model_dir=%s" % out, "--prompt=In the beginning",
         "--max_new_tokens=48", "--batch=2"],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    finished = re.findall(r"finish_reason=(\w+) prompt_tokens=\d+ "
                          r"completion_tokens=(\d+)", result.stderr)
    assert finished, result.stderr
    assert all(reason == "LENGTH" and int(n) == 48
               for reason, n in finished), finished
