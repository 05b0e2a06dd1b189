"""moh-convert end to end: release-style training containers written by
torch.save go in; model.safetensors (read back by an independent Python
reader, tests/reference/checkpoint_io.py) and config.json come out, the weights
checked against the architecture; bad flags and refused pickles fail with
clear messages and exit statuses.

Environment (CTest sets them): MOH_CONVERT (path of moh-convert),
MOH_SOURCE_DIR (the repository). Run with /usr/bin/python3 -m pytest.
"""
import collections
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
import moh_transnext  # noqa: E402

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


def random_state_dict(config, dtype=torch.float32, seed=0):
    """Random tensors with the official names and shapes of `config`."""
    gen = torch.Generator().manual_seed(seed)
    return collections.OrderedDict(
        (name, torch.randn(shape, generator=gen).to(dtype))
        for name, shape in moh_transnext.state_dict_shapes(config).items())


def save_container(path, config=moh_transnext.TINY_CONFIG, **args):
    """A MoH-ViT style container (main.py's checkpoint_dict) of a tiny
    TransNeXt at `path`: the model, AdamW state after one step, the rest."""
    model = moh_transnext.TransNeXt(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    fields = dict(model="moh_transnext_tiny", input_size=config["image_size"])
    fields.update(args)
    torch.save(make.vit_container(model, opt, make.vit_args(**fields)), path)
    return model.state_dict()


def write_config(path, config=moh_transnext.TINY_CONFIG):
    with open(path, "w") as f:
        json.dump(config, f)
    return path


def convert(*flags):
    assert os.access(CONVERT, os.X_OK), "MOH_CONVERT=%r" % CONVERT
    return subprocess.run([CONVERT, *flags], capture_output=True, text=True, timeout=120)


@pytest.fixture
def container(tmp_path):
    path = tmp_path / "moh_transnext_tiny.pth"
    return path, save_container(path)


def test_converts_a_training_container(tmp_path, container):
    path, state_dict = container
    out = tmp_path / "out"
    config = write_config(tmp_path / "config.json")
    result = convert("--input=%s" % path, "--output_dir=%s" % out,
                     "--config=%s" % config)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert "%s: %d tensors from %s's 'model'" % (
        out / "model.safetensors", len(state_dict), path) in result.stdout
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]

    tensors, metadata, data_start = checkpoint_io.load_safetensors(out / "model.safetensors")
    assert metadata == {"format": "pt"} and data_start % 8 == 0
    assert sorted(tensors) == sorted(state_dict)  # No optimizer tensors.
    for name, want in state_dict.items():
        assert tensors[name].dtype == want.dtype, name
        assert torch.equal(tensors[name], want), name
    with open(out / "config.json") as f:
        assert json.load(f) == moh_transnext.TINY_CONFIG


def test_a_released_variant_from_its_saved_args(tmp_path):
    # Full size (small_75, half precision to keep the file small): the
    # variant comes from args.model and the weights are checked against it.
    config = moh_transnext.variant_config("moh_transnext_small_75")
    state_dict = random_state_dict(config, torch.float16)
    path = tmp_path / "moh_transnext_small_75.pth"
    torch.save({"model": state_dict, "epoch": 299,
                "args": make.vit_args(model="moh_transnext_small_75")}, path)
    out = tmp_path / "out"
    result = convert("--input=%s" % path, "--output_dir=%s" % out)
    assert result.returncode == 0, result.stderr
    with open(out / "config.json") as f:
        written = json.load(f)
    assert written == expected_config("moh_transnext_small_75")
    assert list(written) == list(expected_config("x"))  # Field order too.
    assert len(written["labels"]) == 1000 and written["labels"][0] == "tench"
    assert written["labels"][999] == "toilet tissue"
    tensors, _, _ = checkpoint_io.load_safetensors(out / "model.safetensors")
    assert sorted(tensors) == sorted(state_dict)
    assert all(t.dtype == torch.float16 for t in tensors.values())


def test_weights_that_do_not_fit_the_variant_are_refused(tmp_path, container):
    path, _ = container
    out = tmp_path / "out"
    result = convert("--input=%s" % path, "--output_dir=%s" % out,
                     "--variant=moh_transnext_base_50")
    assert result.returncode == 1
    assert ("warning: --variant=moh_transnext_base_50 differs from %s's args.model "
            "'moh_transnext_tiny'" % path) in result.stderr
    assert "args.input_size is 64; the variants' config is 224 pixels" in result.stderr
    assert not out.exists()
    config = dict(moh_transnext.TINY_CONFIG, embed_dims=[8, 16, 32, 64])
    result = convert("--input=%s" % path, "--output_dir=%s" % out,
                     "--config=%s" % write_config(tmp_path / "c.json", config))
    assert result.returncode == 1
    assert "the weights do not fit from %s" % (tmp_path / "c.json") in result.stderr
    assert "has shape [32, 32, 3, 3], expected [64, 32, 3, 3]" in result.stderr
    assert not out.exists()


def test_config_only(tmp_path, container):
    path, _ = container
    out = tmp_path / "out"
    result = convert("--input=%s" % path, "--output_dir=%s" % out, "--config_only",
                     "--config=%s" % write_config(tmp_path / "config.json"))
    assert result.returncode == 0, result.stderr
    assert os.listdir(out) == ["config.json"]


def test_plain_state_dict_needs_variant_or_config(tmp_path):
    path = tmp_path / "weights.pth"
    state_dict = random_state_dict(moh_transnext.TINY_CONFIG)
    torch.save(state_dict, path)
    out = tmp_path / "out"
    result = convert("--input=%s" % path, "--output_dir=%s" % out)
    assert result.returncode == 2
    assert "--variant is required: %s saves no args.model" % path in result.stderr
    assert not out.exists()
    result = convert("--input=%s" % path, "--output_dir=%s" % out,
                     "--config=%s" % write_config(tmp_path / "config.json"))
    assert result.returncode == 0, result.stderr
    tensors, _, _ = checkpoint_io.load_safetensors(out / "model.safetensors")
    assert sorted(tensors) == sorted(state_dict)


def test_saved_model_that_is_no_variant(tmp_path):
    path = tmp_path / "transnext.pth"
    save_container(path, model="transnext_base")
    result = convert("--input=%s" % path, "--output_dir=%s" % (tmp_path / "out"))
    assert result.returncode == 2
    assert "its args.model 'transnext_base' is not a MoH-ViT variant; pass --variant" in result.stderr
    assert all(v in result.stderr for v in VARIANTS)


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
    (["--input=x.pth", "--output_dir=o", "--variant=moh_transnext_base_50", "--config=c.json"],
     2, "--variant and --config exclude each other"),
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
    result = convert("--input=%s" % path, "--output_dir=%s" % (blocker / "out"),
                     "--config=%s" % write_config(tmp_path / "config.json"))
    assert result.returncode == 1
    assert "cannot create --output_dir %s" % (blocker / "out") in result.stderr
