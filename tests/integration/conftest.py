"""Session fixtures of the moh-server integration tests.

The binaries and data come from the environment (CTest sets them):
  MOH_SERVER      path of moh-server
  MOH_CLIENT      path of moh-client
  MOH_FIXTURES    directory written by tests/reference/make_fixtures.py
  MOH_SOURCE_DIR  repository root (for client/python and proto/)
Defaults: SOURCE_DIR/build/{service/moh-server,client/moh-client,fixtures}.

Servers are real processes on free loopback ports, configured through a
text-format file in a temporary directory, killed at teardown. Each server's
log stays in that directory; when a test fails, the part of every server log
written during that test is attached to the failure report.
"""
import importlib
import json
import os
import subprocess
import sys
import types

import pytest

import moh_testlib as lib

_SERVERS = []  # every MohServer started in this session


def _check_inputs():
    missing = [
        "%s=%s" % (what, path)
        for what, path in (("MOH_SERVER", lib.SERVER), ("MOH_CLIENT",
                                                        lib.CLIENT))
        if not os.access(path, os.X_OK)
    ]
    for model in ("llama_learned", "vit_learned"):
        if not os.path.isfile(os.path.join(lib.FIXTURES, model, "golden.json")):
            missing.append("MOH_FIXTURES=%s (no %s/golden.json)" %
                           (lib.FIXTURES, model))
    if missing:
        pytest.exit("integration tests need: " + ", ".join(missing) +
                    " (build moh-server moh-client moh_demo_models, or set "
                    "the environment variables)", returncode=1)


def pytest_sessionstart(session):
    _check_inputs()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    if call.when == "setup":
        item._moh_log_offsets = {id(s): len(s.log()) for s in _SERVERS}
    outcome = yield
    report = outcome.get_result()
    if not report.failed:
        return
    offsets = getattr(item, "_moh_log_offsets", {})
    for server in _SERVERS:
        log = server.log()
        lines = log[offsets.get(id(server), 0):].splitlines()
        if not lines:
            lines = ["(nothing new during this test; the last lines:)"
                     ] + log.splitlines()[-20:]
        if len(lines) > 150:
            lines = ["... (%d lines before; full log: %s)" %
                     (len(lines) - 150, server.log_path)] + lines[-150:]
        report.sections.append(("moh-server log: %s (%s)" %
                                (server.name, server.log_path),
                                "\n".join(lines)))


@pytest.fixture(scope="session")
def workdir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("moh_integration"))


@pytest.fixture(scope="session")
def api(workdir):
    """The generated moh.v1 modules: api.pb (messages), api.grpc (stubs)."""
    stub_dir = os.path.join(workdir, "stubs")
    subprocess.run([
        "bash",
        os.path.join(lib.SOURCE_DIR, "client", "python", "gen_stubs.sh"),
        stub_dir
    ],
                   check=True,
                   timeout=120)
    sys.path.insert(0, stub_dir)
    importlib.invalidate_caches()
    pb = importlib.import_module("moh.v1.inference_pb2")
    pb_grpc = importlib.import_module("moh.v1.inference_pb2_grpc")
    return types.SimpleNamespace(pb=pb, grpc=pb_grpc, stub_dir=stub_dir)


def _start(server, **kwargs):
    _SERVERS.append(server)
    return server.start(**kwargs)


def _starter(workdir):
    """A start(name, models, wait_serving=True, **MohServer kwargs) function
    and the list of the servers it started."""
    started = []

    def start(name, models, wait_serving=True, **kwargs):
        server = lib.MohServer(name, workdir, models, **kwargs)
        started.append(server)
        return _start(server, wait_serving=wait_serving)

    return start, started


@pytest.fixture(scope="session")
def start_server(workdir):
    """start_server(name, models, **MohServer kwargs) -> a started MohServer,
    killed at the end of the session (tests may stop it earlier)."""
    start, started = _starter(workdir)
    yield start
    for server in started:
        server.kill()


@pytest.fixture
def server_factory(workdir):
    """Like start_server, but the servers die at the end of the test."""
    start, started = _starter(workdir)
    yield start
    for server in started:
        server.kill()


@pytest.fixture(scope="session")
def main_server(start_server, api):
    """demo-lm (llama_learned) and demo-vit (vit_learned), metrics on."""
    return start_server("main", [
        ("demo-lm", lib.LM_DIR, "generation { max_running: 4 }"),
        ("demo-vit", lib.VIT_DIR, ""),
    ])


@pytest.fixture(scope="session")
def stub(main_server, api):
    return api.grpc.InferenceStub(main_server.channel())


@pytest.fixture(scope="session")
def long_lm_dir(workdir):
    """The fixture LM that never ends with EOS, 8192 positions (for requests
    that must keep a slot busy for thousands of steps: the fixture decodes
    several thousand tokens a second, so a stream that must outlast a check
    needs them)."""
    return lib.make_long_lm(lib.LM_DIR, os.path.join(workdir, "llama_long"), 8192)


@pytest.fixture(scope="session")
def lm_golden():
    with open(os.path.join(lib.LM_DIR, "golden.json")) as f:
        return json.load(f)


@pytest.fixture(scope="session")
def vit_golden():
    with open(os.path.join(lib.VIT_DIR, "golden.json")) as f:
        return json.load(f)


@pytest.fixture(scope="session")
def decoder():
    return lib.ByteLevelDecoder(os.path.join(lib.LM_DIR, "tokenizer.json"))
