"""The layering of the C++ tree, checked rather than remembered (STYLE.md:
dependencies point one way): which top-level folders each folder's files may
include, which libraries model/ must never see (gRPC, Protobuf's generated
API, Prometheus), and no include cycle among service/'s headers."""
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
        '#include "service/servable.h"\n#include <grpcpp/grpcpp.h>\n')
    monkeypatch.setattr(sys.modules[__name__], "SOURCE_DIR", str(tmp_path))
    with pytest.raises(AssertionError) as error:
        test_each_folder_includes_only_the_layers_below_it("model")
    assert "model/x.h includes service/servable.h" in str(error.value)
    assert "model/x.h includes grpcpp/grpcpp.h" in str(error.value)
