"""Random model directories, drawn by hypothesis: the test models of every
family (the llama LM, the ViT, the TransNeXt, the DiT, the shipped demo LM
with its chat template) with one or two of their files changed at random:
a JSON value anywhere in config.json, generation_config.json,
tokenizer_config.json or tokenizer.json replaced by any other (NaN, huge
numbers, wrong types), removed or joined by a stranger; or a weights file
cut short or overwritten in a few bytes of its header.

A bad model directory is a FAILED model, never a dead server:
- the server lives, every model ends READY or FAILED (none stays LOADING),
  a FAILED one says why in a few lines;
- an untouched model beside them serves as usual;
- a READY one answers a small request of its kind with a result or a
  client's error, never INTERNAL or UNKNOWN.
The draws are the same in every run; MOH_RANDOM_EXAMPLES (default 40)
sets how many directories are drawn (in servers of up to five).
"""
import json
import operator
import os
import shutil
import threading

import grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import moh_testlib as lib

EXAMPLES = int(os.environ.get("MOH_RANDOM_EXAMPLES", "40"))
DIRS_PER_SERVER = 5
# (directory, family): the families decide the request a READY model gets.
BASES = [
    (lib.LM_DIR, "lm"),
    (os.path.join(lib.SOURCE_DIR, "models", "demo-lm"), "lm"),
    (lib.VIT_DIR, "vit"),
    (os.path.join(lib.FIXTURES, "transnext_tiny"), "vit"),
    (os.path.join(lib.FIXTURES, "dit_tiny"), "dit"),
]
JSON_FILES = ("config.json", "generation_config.json",
              "tokenizer_config.json", "tokenizer.json")
WEIGHTS = (".safetensors", ".pt", ".bin")
INT_EXTREMES = [0, -1, 1, 2, 3, 7, 1 << 31, -(1 << 31), 1 << 40, 1 << 63,
                (1 << 64) + 1]


def json_values():
    leaves = st.one_of(
        st.none(), st.booleans(), st.sampled_from(INT_EXTREMES),
        st.integers(-10, 1000),
        st.floats(allow_nan=True, allow_infinity=True),  # NaN: not JSON
        st.text(max_size=10))
    return st.recursive(leaves, json_containers, max_leaves=6)


# Strategies take named functions, not lambdas: hypothesis describes each
# draw's functions, a lambda by reading its source file again.
def json_containers(inner):
    return st.one_of(st.lists(inner, max_size=3),
                     st.dictionaries(st.text(max_size=6), inner, max_size=3))


def paths_of(value, path=()):
    """Every node of a JSON value, as a path of keys and indices."""
    yield path
    if isinstance(value, dict):
        for key, item in value.items():
            yield from paths_of(item, path + (key,))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from paths_of(item, path + (index,))


def like(value):
    """Values of `value`'s own type (a count of 0, -1 or 2^63, a NaN norm
    epsilon, a list one longer), which get past a type check."""
    if isinstance(value, bool):
        return st.booleans()
    if isinstance(value, int):
        return st.one_of(st.sampled_from(INT_EXTREMES),
                         st.integers(-2, 2 * value + 2))
    if isinstance(value, float):
        return st.one_of(st.sampled_from([0.0, -1.0, 1e30, -1e-30]),
                         st.floats(allow_nan=True, allow_infinity=True))
    if isinstance(value, str):
        return st.text(max_size=10)
    if isinstance(value, list) and value:
        return st.lists(like(value[0]), max_size=len(value) + 1)
    return json_values()


def node(document, path):
    for step in path:
        document = document[step]
    return document


@st.composite
def json_edit(draw, document):
    """(path, action, value, key): one change to `document`."""
    paths = list(paths_of(document))
    path = draw(st.sampled_from(paths[1:] if len(paths) > 1 else paths))
    action = draw(st.sampled_from(["like", "like", "replace", "remove",
                                   "add"]))
    if action == "like":
        return path, "replace", draw(like(node(document, path))), ""
    return path, action, draw(json_values()), draw(st.text(max_size=8))


def apply_edit(document, edit):
    path, action, value, key = edit
    if not path:
        return value
    parent, last = node(document, path[:-1]), path[-1]
    if action == "replace":
        parent[last] = value
    elif action == "remove":
        del parent[last]
    elif isinstance(parent[last], dict):
        parent[last][key] = value
    elif isinstance(parent[last], list):
        parent[last].append(value)
    else:
        parent[last] = value
    return document


def files_of(directory):
    return sorted(f for f in os.listdir(directory)
                  if f in JSON_FILES or f.endswith(WEIGHTS))


@st.composite
def file_change(draw, directory):
    """(file name, new bytes) for one file of `directory`."""
    name = draw(st.sampled_from(files_of(directory)))
    with open(os.path.join(directory, name), "rb") as f:
        data = f.read()
    if name in JSON_FILES:
        document = json.loads(data)
        document = apply_edit(document, draw(json_edit(document)))
        return name, json.dumps(document).encode()
    how = draw(st.sampled_from(["cut", "header"]))
    if how == "cut":
        return name, data[:draw(st.integers(0, len(data) - 1))]
    changed = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, min(len(data), 512) - 1))
        changed[at] = draw(st.integers(0, 255))
    return name, bytes(changed)


@st.composite
def model_dirs(draw):
    """(base directory, family, [(file name, bytes)]): one or two changes."""
    base, family = draw(st.sampled_from(BASES))
    changes = draw(st.lists(file_change(base), min_size=1, max_size=2,
                            unique_by=operator.itemgetter(0)))
    return base, family, changes


def write_dir(root, index, base, changes):
    """A copy of `base` with `changes`: links to the files it keeps (and to
    the DiT's VAE beside it, which its config names as ../dit_tiny_vae)."""
    vae = os.path.join(root, "dit_tiny_vae")
    if not os.path.lexists(vae):
        os.makedirs(root, exist_ok=True)
        os.symlink(os.path.join(lib.FIXTURES, "dit_tiny_vae"), vae)
    directory = os.path.join(root, "m%d" % index)
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    changed = dict(changes)
    for name in os.listdir(base):
        target = os.path.join(directory, name)
        if name in changed:
            with open(target, "wb") as f:
                f.write(changed[name])
        else:
            os.symlink(os.path.join(base, name), target)
    return directory


def ask(api, stub, name, family):
    """A small request of the model's kind: None, or the grpc.RpcError."""
    pb = api.pb
    try:
        if family == "lm":
            lib.run_generate(stub, lib.generate_request(
                pb, model=name, prompt="Once upon a time", max_new_tokens=4))
        elif family == "vit":
            stub.Classify(pb.ClassifyRequest(
                model=name, image=lib.solid_png(16, 16)),
                timeout=lib.RPC_TIMEOUT)
        else:
            list(stub.GenerateImage(pb.GenerateImageRequest(
                model=name, class_index=0, steps=2, seed=1),
                timeout=lib.RPC_TIMEOUT))
    except grpc.RpcError as error:
        return error
    return None


CLIENT_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}

_serial = iter(range(1 << 30))
_serial_lock = threading.Lock()


def test_random_model_dirs(api, server_factory, workdir):
    @settings(max_examples=max(2, EXAMPLES // DIRS_PER_SERVER),
              deadline=None, derandomize=True, database=None,
              print_blob=False,
              suppress_health_check=[HealthCheck.too_slow,
                                     HealthCheck.data_too_large,
                                     HealthCheck.function_scoped_fixture])
    @given(st.lists(model_dirs(), min_size=1, max_size=DIRS_PER_SERVER))
    def check(drawn):
        with _serial_lock:
            serial = next(_serial)
        root = os.path.join(workdir, "random_dirs_%d" % serial)
        models = [("good", lib.LM_DIR, "")]
        families = {"good": "lm"}
        for index, (base, family, changes) in enumerate(drawn):
            name = "m%d" % index
            models.append((name, write_dir(root, index, base, changes), ""))
            families[name] = family
        server = server_factory("random_dirs_%d" % serial, models,
                                wait_serving=False, metrics=False)
        try:
            infos = lib.wait_models_loaded(api, server)
            assert server.proc.poll() is None, "moh-server exited"
            stub = api.grpc.InferenceStub(server.channel())
            assert infos["good"].state == api.pb.ModelInfo.READY
            assert ask(api, stub, "good", "lm") is None
            for name, info in infos.items():
                if info.state == api.pb.ModelInfo.FAILED:
                    assert info.failure_reason, name
                    assert len(info.failure_reason) < 4096, info.failure_reason
                    continue
                assert info.state == api.pb.ModelInfo.READY, info
                error = ask(api, stub, name, families[name])
                if error is not None:
                    assert error.code() in CLIENT_ERRORS, (
                        name, error.code(), error.details())
            assert server.proc.poll() is None, "moh-server exited"
        finally:
            server.kill()
            shutil.rmtree(root, ignore_errors=True)

    check()
