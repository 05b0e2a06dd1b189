"""moh-generate-image, in process: its PNG equals the reference's image for
each class, seed, steps, guidance and ratio of the tiny MoH-DiT fixtures
(latent space with a VAE, and pixel space); its timing mode prints the
seconds per step, the rows and the effective ratio; bad usage exits 2 with a
reason; and bench/make_bench_dit.py writes a model it loads and samples.

Environment (CTest sets them): MOH_GENERATE_IMAGE (path of
moh-generate-image), MOH_FIXTURES (tests/reference/make_fixtures.py's
directory), MOH_SOURCE_DIR (the repository). Run with /usr/bin/python3 -m
pytest.
"""
import io
import json
import os
import re
import subprocess
import sys

import pytest
from PIL import Image

TOOL = os.environ.get("MOH_GENERATE_IMAGE", "")
FIXTURES = os.environ.get("MOH_FIXTURES", "")
SOURCE = os.environ.get("MOH_SOURCE_DIR", "")


def tool(*args):
    assert os.access(TOOL, os.X_OK), "MOH_GENERATE_IMAGE=%r" % TOOL
    return subprocess.run([TOOL] + list(args), capture_output=True,
                          text=True, timeout=120)


def samples(model):
    with open(os.path.join(FIXTURES, model, "golden.json")) as f:
        return json.load(f)["samples"]


@pytest.mark.parametrize("model", ["dit_tiny", "dit_tiny_pixels"])
def test_images_equal_the_reference(tmp_path, model):
    for i, s in enumerate(samples(model)):
        out = tmp_path / ("%d.png" % i)
        p = tool("--model_dir=" + os.path.join(FIXTURES, model),
                 "--class=%d" % s["class"], "--seed=%d" % s["seed"],
                 "--steps=%d" % s["steps"], "--guidance=%r" % s["guidance"],
                 "--ratio=%r" % s["ratio"], "--out=%s" % out)
        assert p.returncode == 0, p.stderr
        assert "effective ratio: " in p.stdout
        want = s["image_u8"]  # [C][H][W]
        channels, height, width = len(want), len(want[0]), len(want[0][0])
        with Image.open(io.BytesIO(out.read_bytes())) as image:
            assert image.size == (width, height)
            assert image.mode == ("L" if channels == 1 else "RGB")
            data = list(image.getdata())
        for j, value in enumerate(data):
            y, x = divmod(j, width)
            pixel = value if channels > 1 else (value,)
            for c in range(channels):
                assert abs(pixel[c] - want[c][y][x]) <= 1, (i, c, y, x)


def step_report(stdout):
    m = re.search(r"step seconds: ([\d.]+) \(batch (\d+), rows (\d+),", stdout)
    e = re.search(r"effective ratio: ([\d.]+)", stdout)
    assert m and e, stdout
    return float(m.group(1)), int(m.group(2)), int(m.group(3)), float(
        e.group(1))


@pytest.mark.parametrize("attention", ["auto", "dense"])
def test_timing_mode(attention):
    model = os.path.join(FIXTURES, "dit_tiny")
    # Guided: two rows per request; guidance 1: one.
    for guidance, rows in (("4", 2), ("1", 1)):
        p = tool("--model_dir=" + model, "--batch=3", "--time_steps=2",
                 "--guidance=" + guidance, "--attention=" + attention,
                 "--ratio=0.5")
        assert p.returncode == 0, p.stderr
        seconds, batch, got_rows, effective = step_report(p.stdout)
        assert seconds > 0 and batch == 3 and got_rows == 3 * rows
        assert 0 < effective < 1  # ratio 0.5 leaves heads out


@pytest.mark.parametrize("args, reason", [
    ([], "--model_dir is required"),
    (["--model_dir=M"], "give --out=FILE.png"),
    (["--model_dir=M", "--out=x.png", "--batch=2"], "give --out=FILE.png"),
    (["--model_dir=M", "--time_steps=1", "--attention=sparse"],
     "--attention must be auto or dense"),
    (["--model_dir=M", "--time_steps=1", "--ratio=2"], "--ratio"),
    (["--model_dir=M", "--time_steps=4", "--steps=4"],
     "--steps (4) must exceed --time_steps (4)"),
    (["--model_dir=M", "--out=x.png", "--class=no-such-label"],
     "neither an index nor one of the model's labels"),
])
def test_bad_usage_exits_2_with_the_reason(args, reason):
    args = [a.replace("=M", "=" + os.path.join(FIXTURES, "dit_tiny"))
            for a in args]
    p = tool(*args)
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert reason in p.stderr


def test_bench_model_loads_and_samples(tmp_path):
    out = tmp_path / "bench-dit"
    subprocess.run([sys.executable, os.path.join(SOURCE, "bench",
                                                 "make_bench_dit.py"),
                    "--variant=MoH-DiT-S/2-90", "--input_size=4",
                    "--in_channels=3", "--out=%s" % out],
                   check=True, timeout=120)
    with open(out / "config.json") as f:
        assert json.load(f) == {"model_type": "moh_dit",
                                "variant": "MoH-DiT-S/2-90",
                                "input_size": 4, "in_channels": 3}
    p = tool("--model_dir=%s" % out, "--time_steps=1", "--ratio=0.5")
    assert p.returncode == 0, p.stderr
    # Blocks 0-7 of 12 route; at ratio 0.5 they use 3 of 6 heads.
    assert step_report(p.stdout)[3] == pytest.approx((8 * 3 + 4 * 6) / 72,
                                                     abs=1e-4)
    png = tmp_path / "x.png"
    p = tool("--model_dir=%s" % out, "--steps=2", "--out=%s" % png)
    assert p.returncode == 0, p.stderr
    with Image.open(png) as image:
        assert image.size == (4, 4) and image.mode == "RGB"
