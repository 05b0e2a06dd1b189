"""Hostile inputs through the real server (issue 13): a model directory built
to crash the loader is a FAILED model with a reason, and the other models
keep serving."""
import os
import shutil

import grpc

import moh_testlib as lib


def _nested_normalizer(depth):
    return ('{"type":"Sequence","normalizers":[' * depth +
            '{"type":"Lowercase"}' + "]}" * depth)


def test_deeply_nested_tokenizer_json_fails_its_model_only(
        api, server_factory, workdir):
    hostile = os.path.join(workdir, "nested_tokenizer_lm")
    shutil.copytree(lib.LM_DIR, hostile, dirs_exist_ok=True)
    path = os.path.join(hostile, "tokenizer.json")
    with open(path) as f:
        text = f.read()
    # The same tokenizer with 100000 nested normalizer Sequences in front
    # (a later "normalizer" key would win: drop it).
    text = text.replace('"normalizer"', '"unused_normalizer"', 1)
    with open(path, "w") as f:
        f.write('{"normalizer": ' + _nested_normalizer(100000) + "," +
                text.lstrip()[1:])
    server = server_factory("nested_tokenizer", [
        ("hostile", hostile, ""),
        ("demo-vit", lib.VIT_DIR, ""),
    ], wait_serving=False, metrics=False)
    stub = api.grpc.InferenceStub(server.channel())

    def loaded():
        try:
            models = stub.ListModels(api.pb.ListModelsRequest(), timeout=10)
        except grpc.RpcError:
            return None
        states = {m.name: m for m in models.models}
        if any(m.state == api.pb.ModelInfo.LOADING for m in states.values()):
            return None
        return states

    models = lib.wait_until(loaded, lib.START_TIMEOUT, "models loaded")
    assert server.proc.poll() is None, server.log()
    assert models["hostile"].state == api.pb.ModelInfo.FAILED
    assert "nest at most 16 deep" in models["hostile"].failure_reason
    assert models["demo-vit"].state == api.pb.ModelInfo.READY
    request = api.pb.ClassifyRequest(model="demo-vit")
    request.pixels.shape.extend([3, 16, 16])
    request.pixels.data.extend([0.5] * 768)
    assert len(stub.Classify(request, timeout=lib.RPC_TIMEOUT).classes) == 5
