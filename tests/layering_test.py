"""The layering of the C++ tree, checked rather than remembered (STYLE.md:
dependencies point one way): which top-level folders each folder's files may
include, which libraries model/ must never see (gRPC, Protobuf's generated
API, Prometheus), which of service/'s folders each of its folders may include
(its layers, from config/ up to the two doors), that only the composition
root names every model family, that the C++ tests mirror the source folders
(service/'s test by test, `<layer>/<name>_test.cc` for `<layer>/<name>.h`), and
no include cycle among service/'s headers."""
import os
import re
import sys

import pytest

SOURCE_DIR = os.environ.get(
    "MOH_SOURCE_DIR", os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Folder -> the project folders its files may include ("moh" is the
# generated API and config, proto/moh/v1/*.pb.h).
ALLOWED = {
    "base": {"base"},
    "model": {"base", "model"},
    "service": {"base", "model", "service", "moh"},
    "client": {"base", "client", "moh"},
    "tools": {"base", "model", "service"},
    "bench": {"base", "model"},
}
# Third-party headers a layer must not include, by prefix.
FORBIDDEN_LIBRARIES = {
    "base": ("grpc", "google/protobuf", "prometheus", "torch", "ATen", "c10"),
    "model": ("grpc", "google/protobuf", "prometheus"),
    "client": ("torch", "ATen", "c10", "prometheus"),
}
# service/'s layers: folder -> the service/ folders its files may include.
SERVICE_ALLOWED = {
    "config": {"config"},
    "net": {"net"},
    "metrics": {"metrics"},
    "servable": {"servable", "metrics"},
    "engine": {"engine", "servable", "metrics", "config"},
    "language": {"language", "engine", "servable", "metrics", "config"},
    "vision": {"vision", "engine", "servable", "metrics", "config"},
    "diffusion": {"diffusion", "engine", "servable", "metrics", "config"},
    "serving": {"serving", "language", "vision", "diffusion", "engine",
                "servable", "metrics", "config"},
    "grpc": {"grpc", "serving", "engine", "servable", "metrics", "config"},
    "http": {"http", "serving", "net", "engine", "servable", "metrics",
             "config"},
    # main.cc composes the server: every layer but the families.
    "": {"config", "net", "metrics", "servable", "engine", "serving", "grpc",
         "http"},
}
FAMILIES = {"language", "vision", "diffusion"}
# The one file outside a family's folder that names the families.
COMPOSITION_ROOT = "service/serving/hosted_model.cc"
PROJECT_FOLDERS = {"base", "model", "service", "client", "tools", "bench",
                   "moh", "proto", "tests", "fuzz"}
INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.M)


def sources(folder):
    for root, _, files in os.walk(os.path.join(SOURCE_DIR, folder)):
        for name in files:
            if name.endswith((".h", ".cc", ".cu", ".cuh")):
                yield os.path.join(root, name)


def includes(path):
    with open(path, encoding="utf-8") as f:
        return INCLUDE.findall(f.read())


def relative(path):
    return os.path.relpath(path, SOURCE_DIR)


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_each_folder_includes_only_the_layers_below_it(folder):
    wrong = []
    for path in sources(folder):
        for kind, header in includes(path):
            top = header.split("/")[0]
            if kind == '"' and top in PROJECT_FOLDERS and top not in ALLOWED[folder]:
                wrong.append("%s includes %s" % (relative(path), header))
            if header.startswith(FORBIDDEN_LIBRARIES.get(folder, ())):
                wrong.append("%s includes %s" % (relative(path), header))
    assert not wrong, "\n".join(wrong)


def service_folder(path):
    parts = relative(path).split(os.sep)
    return parts[1] if len(parts) > 2 else ""


def test_service_folders_are_the_layers():
    on_disk = {name for name in os.listdir(os.path.join(SOURCE_DIR, "service"))
               if os.path.isdir(os.path.join(SOURCE_DIR, "service", name))}
    assert on_disk == set(SERVICE_ALLOWED) - {""}


@pytest.mark.parametrize("folder", sorted(SERVICE_ALLOWED))
def test_each_service_folder_includes_only_the_layers_below_it(folder):
    wrong = []
    for path in sources("service"):
        if service_folder(path) != folder:
            continue
        for kind, header in includes(path):
            parts = header.split("/")
            if kind != '"' or parts[0] != "service":
                continue
            included = parts[1] if len(parts) > 2 else ""
            allowed = SERVICE_ALLOWED[folder]
            if relative(path) == COMPOSITION_ROOT:
                allowed = allowed | FAMILIES
            elif folder == "serving":
                allowed = allowed - FAMILIES
            if included not in allowed:
                wrong.append("%s includes %s" % (relative(path), header))
    assert not wrong, "\n".join(wrong)


def test_service_tests_mirror_its_folders():
    # tests/service/<layer>/<name>_test.cc tests service/<layer>/<name>.h.
    strays = []
    for path in sources(os.path.join("tests", "service")):
        rel = os.path.relpath(path, os.path.join(SOURCE_DIR, "tests"))
        if not rel.endswith("_test.cc"):
            continue
        header = os.path.join(SOURCE_DIR, rel[:-len("_test.cc")] + ".h")
        if not os.path.exists(header):
            strays.append(rel)
    assert not strays, "tests with no header of the same name: " + ", ".join(strays)


def test_cpp_tests_mirror_the_source_folders():
    # Every C++ test sits in tests/<folder>/ for a source folder <folder>.
    strays = []
    for path in sources("tests"):
        rel = os.path.relpath(path, os.path.join(SOURCE_DIR, "tests"))
        folder = os.path.dirname(rel)
        if rel.startswith(("reference", "testdata", "sanitizers", "deploy")):
            continue
        if not folder or not os.path.isdir(os.path.join(SOURCE_DIR, folder)):
            strays.append(rel)
    assert not strays, "tests outside a mirrored folder: " + ", ".join(strays)


def test_service_headers_include_no_cycle():
    graph = {}
    for path in sources("service"):
        if path.endswith(".h"):
            graph[relative(path)] = [h for kind, h in includes(path)
                                     if kind == '"' and h.startswith("service/")]
    state = {}  # 1: on the current path, 2: done

    def visit(node, trail):
        state[node] = 1
        for child in graph.get(node, []):
            if state.get(child) == 1:
                cycle = trail[trail.index(child):] + [child]
                raise AssertionError("include cycle: " + " -> ".join(cycle))
            if state.get(child) is None:
                visit(child, trail + [child])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def test_the_checker_sees_a_violation(tmp_path, monkeypatch):
    # The rules above would pass on an empty tree: show they catch one.
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "x.h").write_text(
        '#include "service/servable/servable.h"\n#include <grpcpp/grpcpp.h>\n')
    monkeypatch.setattr(sys.modules[__name__], "SOURCE_DIR", str(tmp_path))
    with pytest.raises(AssertionError) as error:
        test_each_folder_includes_only_the_layers_below_it("model")
    assert "model/x.h includes service/servable/servable.h" in str(error.value)
    assert "model/x.h includes grpcpp/grpcpp.h" in str(error.value)


def test_the_checker_sees_a_layer_violation(tmp_path, monkeypatch):
    for folder, text in (("serving", '#include "service/language/x.h"\n'),
                         ("engine", '#include "service/serving/x.h"\n')):
        (tmp_path / "service" / folder).mkdir(parents=True)
        (tmp_path / "service" / folder / "y.cc").write_text(text)
    monkeypatch.setattr(sys.modules[__name__], "SOURCE_DIR", str(tmp_path))
    for folder, included in (("serving", "language"), ("engine", "serving")):
        with pytest.raises(AssertionError) as error:
            test_each_service_folder_includes_only_the_layers_below_it(folder)
        assert "service/%s/y.cc includes service/%s/x.h" % (folder, included) \
            in str(error.value)
