"""TLS (optionally mutual) and bearer tokens through the real server and
clients, with certificates the test makes (openssl)."""
import os
import signal
import subprocess
import sys

import grpc
import pytest

import moh_testlib as lib

TOKEN = "s3cret-token-for-tests"


def _openssl(*args, cwd):
    subprocess.run(["openssl"] + list(args), cwd=cwd, check=True,
                   capture_output=True)


@pytest.fixture(scope="module")
def pki(workdir):
    """A CA, a server certificate for localhost/127.0.0.1 and a client
    certificate, all signed by the CA; and a token file."""
    d = os.path.join(workdir, "pki")
    os.makedirs(d, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
             "-subj", "/CN=moh test CA", "-keyout", "ca.key", "-out",
             "ca.pem", cwd=d)
    with open(os.path.join(d, "san.ext"), "w") as f:
        f.write("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj",
                 "/CN=" + name, "-keyout", name + ".key", "-out",
                 name + ".csr", cwd=d)
        _openssl("x509", "-req", "-in", name + ".csr", "-CA", "ca.pem",
                 "-CAkey", "ca.key", "-CAcreateserial", "-days", "2",
                 "-extfile", "san.ext", "-out", name + ".pem", cwd=d)
    with open(os.path.join(d, "tokens"), "w") as f:
        f.write("# tokens of the tests\n\nother-token\n%s\n" % TOKEN)
    with open(os.path.join(d, "client_token"), "w") as f:
        f.write(TOKEN + "\n")
    return d


def _read(pki, name):
    with open(os.path.join(pki, name), "rb") as f:
        return f.read()


def _secure_channel(server, pki, client_cert=False):
    credentials = grpc.ssl_channel_credentials(
        root_certificates=_read(pki, "ca.pem"),
        private_key=_read(pki, "client.key") if client_cert else None,
        certificate_chain=_read(pki, "client.pem") if client_cert else None)
    return grpc.secure_channel("localhost:%d" % server.port, credentials)


def _start(server_factory, name, pki, mutual=False, extra="", metrics=False):
    tls = 'tls { cert_file: "%s" key_file: "%s" %s }' % (
        os.path.join(pki, "server.pem"), os.path.join(pki, "server.key"),
        'client_ca_file: "%s"' % os.path.join(pki, "ca.pem") if mutual else "")
    extra = '%s auth_token_file: "%s" %s' % (
        tls, os.path.join(pki, "tokens"), extra)
    server = server_factory(name, [("demo-lm", lib.LM_DIR, "")],
                            wait_serving=False, metrics=metrics, extra=extra)
    channel = _secure_channel(server, pki, client_cert=mutual)

    def serving():
        try:
            return lib.health_check(channel, timeout=2) == "SERVING"
        except grpc.RpcError:
            return False

    lib.wait_until(serving, lib.START_TIMEOUT, "SERVING over TLS")
    return server, channel


def test_tls_and_tokens(api, server_factory, pki):
    server, channel = _start(server_factory, "tls_tokens", pki)
    stub = api.grpc.InferenceStub(channel)
    request = lib.generate_request(api.pb, prompt="hi", max_new_tokens=2)
    # Health checks are open (probes); every Inference call needs a token.
    for metadata in (None, [("authorization", "Bearer wrong")],
                     [("authorization", TOKEN)]):
        error = lib.rpc_error(stub.ListModels, api.pb.ListModelsRequest(),
                              metadata=metadata, timeout=10)
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED, error
        assert "authorization" in error.details()
    error = lib.rpc_error(lib.run_generate, stub, request)
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    good = [("authorization", "Bearer " + TOKEN)]
    models = stub.ListModels(api.pb.ListModelsRequest(), metadata=good,
                             timeout=10)
    assert [m.name for m in models.models] == ["demo-lm"]
    stream = stub.Generate(request, metadata=good, timeout=lib.RPC_TIMEOUT)
    assert list(stream)[-1].usage.completion_tokens == 2
    # Plaintext to the TLS port fails.
    plain = api.grpc.InferenceStub(
        grpc.insecure_channel("127.0.0.1:%d" % server.port))
    error = lib.rpc_error(plain.ListModels, api.pb.ListModelsRequest(),
                          metadata=good, timeout=10)
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    # moh-client speaks TLS and tokens.
    base = [lib.CLIENT, "--server=localhost:%d" % server.port,
            "--tls_ca=" + os.path.join(pki, "ca.pem"), "--timeout=60"]
    ok = subprocess.run(
        base + ["--token_file=" + os.path.join(pki, "client_token"),
                "generate", "hi", "--max_new_tokens=2"],
        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    refused = subprocess.run(base + ["models"], capture_output=True,
                             text=True, timeout=120)
    assert refused.returncode == 1
    assert "UNAUTHENTICATED" in refused.stderr
    # So does the Python example client.
    python = subprocess.run(
        [sys.executable, os.path.join(lib.SOURCE_DIR, "client", "python",
                                      "moh_client.py"),
         "--server=localhost:%d" % server.port,
         "--stubs=" + api.stub_dir,
         "--tls_ca=" + os.path.join(pki, "ca.pem"),
         "--token_file=" + os.path.join(pki, "client_token"), "models"],
        capture_output=True, text=True, timeout=120)
    assert python.returncode == 0, python.stderr
    assert "demo-lm" in python.stdout


def test_tls_without_its_key_is_refused_at_start(pki):
    result = subprocess.run(
        [lib.SERVER, "--tls_cert=" + os.path.join(pki, "server.pem"),
         "--port=1", "--metrics_port=-1", "--http_port=-1"],
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "tls.cert_file and tls.key_file must be set together" in (
        result.stderr)


def test_mutual_tls_requires_a_client_certificate(api, server_factory, pki):
    server, channel = _start(server_factory, "mtls", pki, mutual=True)
    good = [("authorization", "Bearer " + TOKEN)]
    models = api.grpc.InferenceStub(channel).ListModels(
        api.pb.ListModelsRequest(), metadata=good, timeout=10)
    assert len(models.models) == 1
    anonymous = api.grpc.InferenceStub(_secure_channel(server, pki))
    error = lib.rpc_error(anonymous.ListModels, api.pb.ListModelsRequest(),
                          metadata=good, timeout=10)
    assert error.code() == grpc.StatusCode.UNAVAILABLE


def test_health_port_answers_probes_in_plaintext(api, server_factory, pki):
    health_port = lib.free_port()
    server, channel = _start(server_factory, "tls_health", pki,
                             extra="health_port: %d" % health_port)
    plain = grpc.insecure_channel("127.0.0.1:%d" % health_port)
    assert lib.health_check(plain) == "SERVING"
    assert lib.health_check(plain, "moh.v1.Inference") == "SERVING"
    # Only health: the Inference service is not there.
    error = lib.rpc_error(api.grpc.InferenceStub(plain).ListModels,
                          api.pb.ListModelsRequest(), timeout=10)
    assert error.code() == grpc.StatusCode.UNIMPLEMENTED
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=60) == 0


def _https_get(url, pki, client_cert=False):
    import ssl
    import urllib.request
    context = ssl.create_default_context(cafile=os.path.join(pki, "ca.pem"))
    if client_cert:
        context.load_cert_chain(os.path.join(pki, "client.pem"),
                                os.path.join(pki, "client.key"))
    with urllib.request.urlopen(url, timeout=10, context=context) as response:
        return response.read().decode("utf-8")


def test_metrics_speak_https_with_the_servers_certificate(server_factory, pki):
    server, _ = _start(server_factory, "tls_metrics", pki, metrics=True)
    url = "localhost:%d/metrics" % server.metrics_port
    assert "moh_requests_total" in _https_get("https://" + url, pki) or (
        "moh_" in _https_get("https://" + url, pki))
    # Plain HTTP gets no metrics.
    with pytest.raises(Exception):
        lib.http_get("http://" + url, timeout=5)


def test_metrics_require_a_client_certificate_under_mutual_tls(
        server_factory, pki):
    server, _ = _start(server_factory, "mtls_metrics", pki, mutual=True,
                       metrics=True)
    url = "https://localhost:%d/metrics" % server.metrics_port
    assert "moh_" in _https_get(url, pki, client_cert=True)
    with pytest.raises(Exception):
        _https_get(url, pki)


def test_metrics_host_binds_the_exporter_alone(api, server_factory):
    # The exporter on 127.0.0.2 only: not reachable on the gRPC address.
    server = server_factory("metrics_host", [("demo-lm", lib.LM_DIR, "")],
                            extra='metrics_host: "127.0.0.2"')
    text = lib.http_get("http://127.0.0.2:%d/metrics" % server.metrics_port)
    assert "moh_" in text
    with pytest.raises(Exception):
        lib.http_get("http://127.0.0.1:%d/metrics" % server.metrics_port,
                     timeout=5)
