"""moh-convert end to end: release-style training containers written by
torch.save go in; model.safetensors (read back by an independent Python
reader, tests/reference/checkpoint_io.py) and config.json come out; bad flags
and refused pickles fail with clear messages and exit statuses.

Environment (CTest sets them): MOH_CONVERT (path of moh-convert),
MOH_SOURCE_DIR (the repository). Run with /usr/bin/python3 -m pytest.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

CONVERT = os.environ.get("MOH_CONVERT", "")
SOURCE = os.environ.get("MOH_SOURCE_DIR", "")
sys.path.insert(0, os.path.join(SOURCE, "tests", "reference"))
import checkpoint_io  # noqa: E402
import ckpt_make_test_checkpoints as make  # noqa: E402

VARIANTS = ["moh_transnext_base_75", "moh_transnext_base_50",
            "moh_transnext_small_80", "moh_transnext_small_75"]


def labels():
    with open(os.path.join(SOURCE, "tools", "data", "imagenet1k_labels.txt")) as f:
        return f.read().splitlines()


def expected_config(variant):
    return {"model_type": "moh_transnext", "variant": variant, "image_size": 224,
            "pretrain_size": 224, "resize_size": 256, "num_channels": 3,
            "labels": labels(), "image_mean": [0.485, 0.456, 0.406],
            "image_std": [0.229, 0.224, 0.225]}


def save_container(path, **args):
    """A MoH-ViT style container (main.py's checkpoint_dict) at `path`."""
    model, opt = make.trained(1234)
    torch.save(make.vit_container(model, opt, make.vit_args(**args)), path)
    return model.state_dict()


def convert(*flags):
    assert os.access(CONVERT, os.X_OK), "MOH_CONVERT=%r" % CONVERT
    return subprocess.run([CONVERT, *flags], capture_output=True, text=True, timeout=60)


@pytest.fixture
def container(tmp_path):
    path = tmp_path / "moh_transnext_small_75.pth"
    return path, save_container(path)


def test_converts_a_training_container(tmp_path, container):
    path, state_dict = container
    out = tmp_path / "out"
    result = convert("--input=%s" % path, "--output_dir=%s" % out)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert "%s: 8 tensors from %s's 'model'" % (out / "model.safetensors", path) in result.stdout
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]

    tensors, metadata, data_start = checkpoint_io.load_safetensors(out / "model.safetensors")
    assert metadata == {"format": "pt"} and data_start % 8 == 0
    assert sorted(tensors) == sorted(state_dict)  # No optimizer tensors.
    for name, want in state_dict.items():
        assert tensors[name].dtype == want.dtype, name  # As stored: bf16, int64.
        assert torch.equal(tensors[name], want), name

    with open(out / "config.json") as f:
        config = json.load(f)
    assert config == expected_config("moh_transnext_small_75")
    assert list(config) == list(expected_config("x"))  # Field order too.
    assert len(config["labels"]) == 1000 and config["labels"][0] == "tench"
    assert config["labels"][999] == "toilet tissue"


def test_variant_flag_wins_with_a_warning(tmp_path, container):
    path, _ = container
    out = tmp_path / "out"
    result = convert("--input=%s" % path, "--output_dir=%s" % out,
                     "--variant=moh_transnext_base_50")
    assert result.returncode == 0, result.stderr
    assert ("warning: --variant=moh_transnext_base_50 differs from %s's args.model "
            "'moh_transnext_small_75'" % path) in result.stderr
    with open(out / "config.json") as f:
        assert json.load(f)["variant"] == "moh_transnext_base_50"


def test_config_only(tmp_path, container):
    path, _ = container
    out = tmp_path / "out"
    result = convert("--input=%s" % path, "--output_dir=%s" % out, "--config_only")
    assert result.returncode == 0, result.stderr
    assert os.listdir(out) == ["config.json"]
    with open(out / "config.json") as f:
        assert json.load(f) == expected_config("moh_transnext_small_75")


def test_plain_state_dict_needs_variant(tmp_path):
    model, _ = make.trained(5)
    path = tmp_path / "weights.pth"
    torch.save(model.state_dict(), path)
    out = tmp_path / "out"
    result = convert("--input=%s" % path, "--output_dir=%s" % out)
    assert result.returncode == 2
    assert "--variant is required: %s saves no args.model" % path in result.stderr
    assert not out.exists()
    result = convert("--input=%s" % path, "--output_dir=%s" % out,
                     "--variant=moh_transnext_base_75")
    assert result.returncode == 0, result.stderr
    tensors, _, _ = checkpoint_io.load_safetensors(out / "model.safetensors")
    assert sorted(tensors) == sorted(model.state_dict())


def test_saved_model_that_is_no_variant(tmp_path):
    path = tmp_path / "transnext.pth"
    save_container(path, model="transnext_base")
    result = convert("--input=%s" % path, "--output_dir=%s" % (tmp_path / "out"))
    assert result.returncode == 2
    assert "its args.model 'transnext_base' is not a MoH-ViT variant; pass --variant" in result.stderr
    assert all(v in result.stderr for v in VARIANTS)


def test_other_input_size_is_refused(tmp_path):
    path = tmp_path / "big.pth"
    save_container(path, input_size=384)
    result = convert("--input=%s" % path, "--output_dir=%s" % (tmp_path / "out"))
    assert result.returncode == 1
    assert "args.input_size is 384; only 224-pixel checkpoints" in result.stderr


def test_refused_pickle_fails_with_the_unpicklers_message(tmp_path):
    marker = tmp_path / "marker"
    path = tmp_path / "evil.pth"
    save_container(path, hook=make._Evil(str(marker)))
    out = tmp_path / "out"
    result = convert("--input=%s" % path, "--output_dir=%s" % out)
    assert result.returncode == 1
    assert result.stderr.startswith("moh-convert: %s/" % path)
    assert "data.pkl: refusing to load global 'posix.system'" in result.stderr
    assert not marker.exists() and not out.exists()


@pytest.mark.parametrize("flags, status, message", [
    ([], 2, "moh-convert: --input is required"),
    (["--input=x.pth"], 2, "moh-convert: --output_dir is required"),
    (["--input=x.pth", "--output_dir=o", "--variant=moh_vit_base"], 2,
     "--variant='moh_vit_base' is not a MoH-ViT variant (allowed: " + ", ".join(VARIANTS) + ")"),
    (["--input=x.pth", "--output_dir=o", "extra"], 2, "unexpected argument 'extra'"),
    (["--no_such_flag=1"], 1, "Unknown command line flag 'no_such_flag'"),
    (["--input=/nonexistent/x.pth", "--output_dir=o"], 1,
     "moh-convert: cannot open /nonexistent/x.pth"),
])
def test_bad_usage(tmp_path, flags, status, message):
    result = subprocess.run([CONVERT, *flags], capture_output=True, text=True,
                            timeout=60, cwd=tmp_path)
    assert result.returncode == status, result.stderr
    assert message in result.stderr
    assert os.listdir(tmp_path) == []


def test_output_dir_that_is_a_file(tmp_path, container):
    path, _ = container
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = convert("--input=%s" % path, "--output_dir=%s" % (blocker / "out"))
    assert result.returncode == 1
    assert "cannot create --output_dir %s" % (blocker / "out") in result.stderr
