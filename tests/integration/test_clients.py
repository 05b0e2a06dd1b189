"""The shipped clients against the real server: the example Python client
(client/python/moh_client.py, with stubs from gen_stubs.sh) and the moh-client
command-line tool."""
import importlib
import json
import os
import subprocess
import sys

import grpc
import pytest

import moh_testlib as lib

with open(os.path.join(lib.LM_DIR, "golden.json")) as f:
    _LM = json.load(f)
with open(os.path.join(lib.VIT_DIR, "golden.json")) as f:
    _VIT = json.load(f)


@pytest.fixture(scope="module")
def moh_client(api):
    sys.path.insert(0, os.path.join(lib.SOURCE_DIR, "client", "python"))
    try:
        return importlib.import_module("moh_client")
    finally:
        sys.path.pop(0)


@pytest.fixture
def client(moh_client, main_server, api):
    with moh_client.MohClient(main_server.target, timeout=lib.RPC_TIMEOUT,
                              stub_dir=api.stub_dir) as c:
        yield c


def test_python_client_all_rpcs(api, client, main_server, decoder, tmp_path):
    # ListModels.
    models = {m.name: m for m in client.list_models()}
    assert sorted(models) == ["demo-lm", "demo-vit"]
    assert all(m.state == client.pb.ModelInfo.READY for m in models.values())
    # Generate, streaming: the golden continuation, then a text prompt.
    case = next(c for c in _LM["cases"] if c["ratio"] == 0.5)
    messages = list(client.generate(token_ids=_LM["prompts"][case["prompt"]],
                                    model="demo-lm", max_new_tokens=8,
                                    temperature=0.0, ratio=0.5))
    assert lib.token_ids_of(messages) == case["greedy"]
    assert messages[-1].effective_activation_ratio == pytest.approx(0.5)
    messages = list(client.generate("Once upon a time", model="demo-lm",
                                    max_new_tokens=6))
    assert len(messages) > 1
    assert "".join(m.text for m in messages) == decoder.decode(
        lib.token_ids_of(messages))
    assert messages[-1].finish_reason == client.pb.LENGTH
    # Classify: a PNG made here, and text + labels.
    pixels = _VIT["pixels"][0]
    response = client.classify(image=lib.encode_png(pixels), model="demo-vit")
    assert len(response.classes) == 5
    assert response.classes[0].label == "two"  # the golden's class
    response = client.classify(text="the cat sat", labels=["a", "b"],
                               model="demo-lm", top_n=1)
    assert len(response.classes) == 1 and response.classes[0].label in "ab"
    # Classify with pixels: moh_client.py has no helper for it; the same
    # generated module and the grpc stubs from gen_stubs.sh do it.
    stub = api.grpc.InferenceStub(main_server.channel())
    request = api.pb.ClassifyRequest(model="demo-vit")
    request.pixels.shape.extend([3, 16, 16])
    request.pixels.data.extend(v for c in pixels for row in c for v in row)
    by_pixels = stub.Classify(request, timeout=lib.RPC_TIMEOUT)
    assert [c.index for c in by_pixels.classes][:1] == [2]


def test_python_client_cancel_and_errors(client):
    call = client.generate("Once upon a time", model="demo-lm",
                           max_new_tokens=200)
    first = next(call)
    assert first.token_ids
    call.cancel()
    with pytest.raises(grpc.RpcError) as error:
        list(call)
    assert error.value.code() == grpc.StatusCode.CANCELLED
    with pytest.raises(grpc.RpcError) as error:
        list(client.generate("hi", model="nope"))
    assert error.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(ValueError):
        client.generate("hi", token_ids=[1])  # checked before sending


def test_python_client_as_a_program(main_server, api):
    script = os.path.join(lib.SOURCE_DIR, "client", "python", "moh_client.py")

    def run(*args):
        return subprocess.run(
            [sys.executable, script, "--server=" + main_server.target,
             "--timeout=60", "--stubs=" + api.stub_dir] + list(args),
            capture_output=True, text=True, timeout=120)

    result = run("models")
    assert result.returncode == 0, result.stderr
    assert "demo-lm" in result.stdout and "READY" in result.stdout
    result = run("generate", "Once upon a time", "--model=demo-lm",
                 "--max_new_tokens=4")
    assert result.returncode == 0, result.stderr
    assert "finish_reason: LENGTH" in result.stderr
    result = run("generate", "hi", "--model=nope")
    assert result.returncode == 1
    assert "NOT_FOUND" in result.stderr and "nope" in result.stderr


# --- moh-client ---


def cli(server, *args, timeout=120):
    return subprocess.run([lib.CLIENT, "--server=" + server.target,
                           "--timeout=60"] + list(args),
                          capture_output=True, text=True, timeout=timeout)


def test_cli_models(main_server):
    result = cli(main_server, "models")
    assert result.returncode == 0, result.stderr
    for word in ("demo-lm", "demo-vit", "READY", "llama", "vit", "learned"):
        assert word in result.stdout, result.stdout


def test_cli_generate_prints_the_text(api, stub, main_server):
    request = lib.generate_request(api.pb, prompt="Once upon a time",
                                   max_new_tokens=8)
    expected = "".join(m.text for m in lib.run_generate(stub, request))
    result = cli(main_server, "generate", "Once upon a time",
                 "--model=demo-lm", "--max_new_tokens=8")
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected  # not a terminal: the text as is
    assert "finish_reason: LENGTH" in result.stderr
    assert "completion_tokens 8" in result.stderr


def test_cli_generate_token_ids_with_routing(main_server, decoder):
    case = next(c for c in _LM["cases"] if c["ratio"] == 1.0)
    ids = ",".join(str(t) for t in _LM["prompts"][case["prompt"]])
    result = cli(main_server, "generate", "--token_ids=" + ids,
                 "--max_new_tokens=8", "--ratio=1.0", "--temperature=0",
                 "--routing")
    assert result.returncode == 0, result.stderr
    assert result.stdout == decoder.decode(case["greedy"])
    assert "head load" in result.stderr
    assert "effective 1.000" in result.stderr


def test_cli_classify_png_file(main_server, tmp_path):
    path = tmp_path / "image.png"
    path.write_bytes(lib.encode_png(_VIT["pixels"][0]))
    result = cli(main_server, "classify", str(path), "--model=demo-vit",
                 "--top_n=2")
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines()]
    assert rows[0][:3] == ["LABEL", "INDEX", "SCORE"]
    assert [r[0] for r in rows[1:]] == ["two", "four"]  # golden's top 2


def test_cli_classify_text(main_server):
    result = cli(main_server, "classify", "--text=the cat sat",
                 "--labels=yes,no", "--model=demo-lm")
    assert result.returncode == 0, result.stderr
    assert sorted(line.split()[0] for line in
                  result.stdout.splitlines()[1:]) == ["no", "yes"]


def test_cli_health(main_server, server_factory, workdir):
    result = cli(main_server, "health")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "SERVING"
    result = cli(main_server, "health", "--service=moh.v1.Inference")
    assert (result.returncode, result.stdout.strip()) == (0, "SERVING")
    broken = server_factory("cli_broken", [
        ("broken", os.path.join(workdir, "no_such_model"), "")
    ], wait_serving=False, metrics=False)
    result = cli(broken, "health")
    assert result.returncode == 1
    assert result.stdout.strip() == "NOT_SERVING"


def test_cli_errors_exit_nonzero_with_the_server_message(main_server):
    result = cli(main_server, "generate", "hi", "--model=nope")
    assert result.returncode == 1
    assert "NOT_FOUND" in result.stderr
    assert "model 'nope' is not served here" in result.stderr
    result = cli(main_server, "generate", "hi", "--ratio=1.5")
    assert result.returncode == 1
    assert "INVALID_ARGUMENT" in result.stderr
    assert "activation.ratio" in result.stderr
    result = cli(main_server, "classify", "--text=x", "--labels=a",
                 "--model=demo-vit")
    assert result.returncode == 1
    assert "INVALID_ARGUMENT" in result.stderr and "text" in result.stderr
