"""The HTTP door hardened (issue 29), through the real server: a value of the
wrong type anywhere in a request is a 400 naming the field, and the other
requests go on; a request without a valid token is refused from its headers
(its body never read) and counted; client text comes back abbreviated on both
doors; the ratio reported is the ratio applied."""
import json
import os
import socket
import threading
import time

import grpc
import pytest

import moh_testlib as lib

DEMO_LM = os.path.join(lib.SOURCE_DIR, "models", "demo-lm")
DEMO_VIT = os.path.join(lib.SOURCE_DIR, "models", "demo-vit")
DEMO_DIT = os.path.join(lib.SOURCE_DIR, "models", "demo-dit")


@pytest.fixture(scope="module")
def server(start_server):
    return start_server("http_hardening", [("demo-lm", DEMO_LM, ""),
                                           ("demo-vit", DEMO_VIT, ""),
                                           ("demo-dit", DEMO_DIT, "")],
                        http=True)


def raw(port, head, body=b"", timeout=lib.RPC_TIMEOUT, read_all=True):
    """Sends `head` (request line and headers, without the blank line; the
    connection closes after the answer) and `body`; returns (status, parsed
    body, bytes of the whole answer). read_all=False: stops at the end of the
    answer's Content-Length, with the request's body unsent."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head.encode() + b"\r\nConnection: close\r\n\r\n" + body)
        data = b""
        while True:
            try:
                chunk = s.recv(65536)
            except (ConnectionResetError, socket.timeout):
                break
            if not chunk:
                break
            data += chunk
            if not read_all and b"\r\n\r\n" in data:
                header, _, rest = data.partition(b"\r\n\r\n")
                length = [int(line.split(b":")[1]) for line in header.split(b"\r\n")
                          if line.lower().startswith(b"content-length:")]
                if length and len(rest) >= length[0]:
                    break
    header, _, payload = data.partition(b"\r\n\r\n")
    status = int(header.split(b" ")[1]) if header else 0
    try:
        parsed = json.loads(payload)
    except ValueError:
        parsed = payload.decode(errors="replace")
    return status, parsed, len(data)


def post(port, path, payload, headers=""):
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return raw(port, "POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               "Content-Length: %d%s" % (path, len(body), headers), body)


BAD_PARTS = [
    ({"type": 7, "text": "hi"}, "messages[0].content[0].type"),
    ({"type": None, "text": "hi"}, "messages[0].content[0].type"),
    ({"type": ["text"], "text": "hi"}, "messages[0].content[0].type"),
    ({"type": {"a": 1}, "text": "hi"}, "messages[0].content[0].type"),
    ({"text": "hi"}, "messages[0].content[0].type"),
    ({"type": "text", "text": 5}, "messages[0].content[0].text"),
    ({"type": "text"}, "messages[0].content[0].text"),
    (3, "messages[0].content[0]"),
]


def test_wrong_types_are_a_400_naming_the_field_and_harm_no_one(server):
    port = server.http_port
    results, errors = [], []

    def healthy():
        try:
            results.append(post(port, "/v1/completions", {
                "model": "demo-lm", "prompt": "In the beginning",
                "max_tokens": 24, "temperature": 0}))
        except OSError as e:  # the server died under it
            errors.append(e)

    threads = [threading.Thread(target=healthy) for _ in range(6)]
    for t in threads:
        t.start()
    for part, field in BAD_PARTS * 3:
        status, body, _ = post(port, "/v1/chat/completions", {
            "model": "demo-lm", "max_tokens": 4,
            "messages": [{"role": "user", "content": [part]}]})
        assert status == 400, (part, body)
        assert body["error"]["message"].startswith(field), (part, body)
        assert body["error"]["type"] == "invalid_request_error"
    for t in threads:
        t.join()
    assert server.proc.poll() is None, server.log()
    assert not errors
    assert [r[0] for r in results] == [200] * 6
    assert all(r[1]["usage"]["completion_tokens"] == 24 for r in results)


def test_client_text_comes_back_abbreviated_on_both_doors(api, server):
    port = server.http_port
    # An unknown field whose name is 1 MB.
    name = "f" * (1 << 20)
    status, body, size = post(port, "/v1/completions",
                              b'{"prompt": "x", "%s": 1}' % name.encode())
    assert status == 400 and size < 4096, (status, size)
    assert "is not a field of this endpoint" in body["error"]["message"]
    assert "(1048576 bytes)" in body["error"]["message"]
    # A long unknown path (within libmicrohttpd's request-line memory).
    status, body, size = raw(port, "GET /%s HTTP/1.1\r\nHost: x" % ("p" * 16000))
    assert status == 404 and size < 4096, (status, size)
    # A model name of 1 MB.
    status, body, size = post(port, "/v1/completions",
                              {"model": "m" * (1 << 20), "prompt": "x"})
    assert status == 404 and size < 4096, (status, size)
    # gRPC: a 10 KB class_label is INVALID_ARGUMENT (it used to overflow the
    # client's metadata limit and read RESOURCE_EXHAUSTED).
    stub = api.grpc.InferenceStub(server.channel())
    request = api.pb.GenerateImageRequest(model="demo-dit", class_label="c" * 10240)
    error = lib.rpc_error(lambda: lib.drain_stream(stub.GenerateImage(
        request, timeout=lib.RPC_TIMEOUT), lib.RPC_TIMEOUT))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert len(error.details()) < 1024 and "class_label" in error.details()


def test_the_reported_ratio_is_the_applied_one(api, server):
    port = server.http_port
    # Left unset: the model's trained default (demo-lm 0.75, demo-vit 0.625).
    status, body, _ = post(port, "/v1/completions", {
        "model": "demo-lm", "prompt": "In the beginning", "max_tokens": 2})
    assert status == 200
    assert body["moh"]["activation_ratio"] == pytest.approx(0.75)
    stub = api.grpc.InferenceStub(server.channel())
    messages = lib.run_generate(stub, lib.generate_request(
        api.pb, prompt="In the beginning", model="demo-lm", max_new_tokens=2))
    assert messages[-1].activation_ratio == pytest.approx(0.75)
    request = api.pb.ClassifyRequest(model="demo-vit")
    request.pixels.shape.extend([1, 8, 8])
    request.pixels.data.extend([0.5] * 64)
    response = stub.Classify(request, timeout=lib.RPC_TIMEOUT)
    assert response.activation_ratio == pytest.approx(0.625)
    # Asked for: that one.
    status, body, _ = post(port, "/v1/completions", {
        "model": "demo-lm", "prompt": "In the beginning", "max_tokens": 2,
        "activation_ratio": 0.5})
    assert body["moh"]["activation_ratio"] == pytest.approx(0.5)


def test_unauthenticated_requests_are_refused_from_their_headers(
        server_factory, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("sesame\n")
    server = server_factory("http_auth_early", [("demo-lm", DEMO_LM, "")],
                            http=True, extra='auth_token_file: "%s"' % tokens)
    port = server.http_port
    before = lib.metric_value(server.samples(), "moh_requests_total", model="",
                              rpc="ChatCompletions", code="UNAUTHENTICATED") or 0
    # Headers announcing 50 MB, no body sent: the answer comes without it
    # (before, the server waited for the body: no answer within the socket's
    # timeout).
    status, body, _ = raw(port, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                          "Content-Type: application/json\r\n"
                          "Content-Length: 50000000", timeout=10, read_all=False)
    assert status == 401, body
    # The same with a token but over max_message_mb (64 MiB): 413 from the
    # headers.
    status, body, _ = raw(port, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                          "Authorization: Bearer sesame\r\n"
                          "Content-Length: %d" % (100 << 20), read_all=False)
    assert status == 413, body
    assert "max_message_mb" in body["error"]["message"]
    samples = server.samples()
    assert lib.metric_value(samples, "moh_requests_total", model="",
                            rpc="ChatCompletions",
                            code="UNAUTHENTICATED") == before + 1
    assert lib.metric_value(samples, "moh_requests_total", model="",
                            rpc="ChatCompletions", code="OUT_OF_RANGE") >= 1
    # A small body without a token is read and dropped, then refused: the
    # client, which sends its whole body before reading, reads the 401 every
    # time (answered from the headers, the closing connection would drop the
    # body it was still sending and reset the answer in flight).
    for _ in range(20):
        status, body, _ = post(port, "/v1/completions",
                               {"model": "demo-lm", "prompt": "x" * 300000})
        assert status == 401, body
    # /health stays open; a client with the token is served.
    assert raw(port, "GET /health HTTP/1.1\r\nHost: x")[0] == 200
    status, body, _ = post(port, "/v1/completions",
                           {"model": "demo-lm", "prompt": "x", "max_tokens": 2},
                           headers="\r\nAuthorization: Bearer sesame")
    assert status == 200, body


def test_http_requests_are_prepared_on_the_request_workers(server_factory):
    # gRPC's request workers prepare HTTP requests too: one worker, room for
    # one waiting request, and a burst of heavy prompts overflows it with
    # 429s naming request_queue; the server serves on.
    import concurrent.futures
    server = server_factory("http_request_queue", [("demo-lm", lib.LM_DIR, "")],
                            http=True, metrics=False,
                            extra="request_threads: 1\nrequest_queue: 1")
    prompt = "the quick brown fox jumps over the lazy dog " * 23000

    def call(_):
        status, body, _ = post(server.http_port, "/v1/completions",
                               {"prompt": prompt, "max_tokens": 1})
        return status, body["error"]["message"] if status != 200 else ""

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(call, range(16)))
    busy = [m for s, m in results if s == 429]
    assert busy, results
    assert all("request_queue" in m for m in busy), busy
    # The others are refused for the context (after tokenizing on a worker).
    assert {s for s, _ in results} <= {429, 400}, results
    status, body, _ = post(server.http_port, "/v1/completions",
                           {"prompt": "hi", "max_tokens": 2})
    assert status == 200, body


def test_bodies_in_flight_share_one_budget(server_factory):
    server = server_factory("http_body_budget", [("demo-lm", lib.LM_DIR, "")],
                            http=True, extra="max_message_mb: 1\n"
                            "http_body_memory_mb: 1")
    port = server.http_port
    # A slow client announces 900 KB and sends a little: it holds them.
    slow = socket.create_connection(("127.0.0.1", port), timeout=lib.RPC_TIMEOUT)
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                 b"Content-Type: application/json\r\nContent-Length: 900000\r\n"
                 b"\r\n{\"prompt\": \"")
    time.sleep(0.5)
    # Another 200 KB does not fit beside them: 503, decided from its headers
    # (its body is read and dropped, never held, so that the client, which
    # sends it before reading, reads the answer).
    status, body, _ = raw(port, "POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                          "Content-Length: 200000", body=b"x" * 200000,
                          read_all=False)
    assert status == 503, body
    assert "http_body_memory_mb" in body["error"]["message"]
    assert lib.metric_value(server.samples(), "moh_requests_total", model="",
                            rpc="Completions", code="UNAVAILABLE") >= 1
    # Once the slow client leaves, its bytes are free again.
    slow.close()
    deadline = time.monotonic() + 10
    while True:
        status, body, _ = post(port, "/v1/completions",
                               {"prompt": "x" * 200000, "max_tokens": 1})
        if status != 503 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert status != 503, body


def served_beside(port, flood, health_timeout):
    """While each connection of `flood` (a "P" sent) sends its request line a
    byte at a time, /health answers within `health_timeout` seconds each
    time and a completion is served."""
    for step in range(1, 4):
        for s in flood:
            try:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\n"[step:step + 1])
            except OSError:  # closed by a limit
                pass
        status, body, _ = raw(port, "GET /health HTTP/1.1\r\nHost: x",
                              timeout=health_timeout)
        assert status == 200, body
    status, body, _ = post(port, "/v1/completions",
                           {"prompt": "x", "max_tokens": 2})
    assert status == 200, body


def test_one_client_cannot_take_every_connection(server_factory):
    # A slow client (from 127.0.0.2) opens 4x the per-client limit of
    # connections and sends its headers a byte at a time: it holds 8 of the
    # 16 slots, and /health and a completion from another address are
    # answered (without the limit /health gets no answer before the socket's
    # 5 s timeout: the idle timeout, 60 s, is what would free a slot).
    server = server_factory("http_per_client", [("demo-lm", DEMO_LM, "")],
                            http=True, metrics=False,
                            extra="http_max_connections: 16\n"
                            "http_max_connections_per_client: 8")
    port = server.http_port
    flood = []
    try:
        for _ in range(32):
            s = socket.socket()
            s.bind(("127.0.0.2", 0))
            s.settimeout(5)
            try:
                s.connect(("127.0.0.1", port))
                s.sendall(b"P")
            except OSError:
                s.close()
                continue
            flood.append(s)
        served_beside(port, flood, health_timeout=5)
    finally:
        for s in flood:
            s.close()


def server_threads(server):
    with open("/proc/%d/status" % server.proc.pid) as status:
        return int(next(line for line in status if line.startswith("Threads:"))
                   .split()[1])


def slow_clients(port, count, addresses):
    """`count` connections from `addresses` loopback addresses (127.0.0.2,
    ...), each with the first byte of a request sent."""
    flood = []
    for i in range(count):
        s = socket.socket()
        s.bind(("127.0.0.%d" % (2 + i % addresses), 0))
        s.settimeout(5)
        s.connect(("127.0.0.1", port))
        s.sendall(b"P")
        flood.append(s)
    return flood


def test_slow_clients_from_many_addresses_hold_no_thread(server_factory):
    # 150 connections from 30 addresses (under the per-client limit) send
    # their headers a byte at a time. Connections are sockets polled by
    # http_threads, not a thread each: the server's thread count does not
    # grow with them, and /health answers within a second, a completion is
    # served, while every slow client is still connected.
    server = server_factory("http_slow_flood", [("demo-lm", DEMO_LM, "")],
                            http=True, metrics=False)
    port = server.http_port
    assert raw(port, "GET /health HTTP/1.1\r\nHost: x")[0] == 200
    threads = server_threads(server)
    flood = slow_clients(port, 150, 30)
    try:
        served_beside(port, flood, health_timeout=1)
        assert server_threads(server) <= threads + 2
        # Still connected: none was closed to make room.
        for s in flood:
            s.sendall(b"O")
    finally:
        for s in flood:
            s.close()


def closed_while_dribbling(s, data, seconds):
    """Sends `data` a byte every 0.1 s for at most `seconds`; whether the
    server closed the connection meanwhile."""
    end = time.monotonic() + seconds
    for i in range(len(data)):
        if time.monotonic() > end:
            return False
        try:
            s.sendall(data[i:i + 1])
        except OSError:
            return True
        time.sleep(0.1)
    try:
        return s.recv(1024) == b""
    except OSError:
        return True


def test_header_and_body_deadlines_are_not_reset_by_bytes(server_factory):
    # Deadlines of 1 s for the headers and 1 s for the body: a client that
    # keeps sending a byte every 0.1 s (which resets the idle timeout, 60 s)
    # is closed well before it could finish.
    server = server_factory("http_deadlines", [("demo-lm", DEMO_LM, "")],
                            http=True,
                            extra="http_header_timeout_seconds: 1\n"
                            "http_body_timeout_seconds: 1")
    port = server.http_port
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 400
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        assert closed_while_dribbling(s, head, 30)
    # The metrics port's headers have the same deadline.
    with socket.create_connection(("127.0.0.1", server.metrics_port),
                                  timeout=5) as s:
        assert closed_while_dribbling(s, b"GET /metrics HTTP/1.1\r\nX-Pad: " +
                                      b"a" * 400, 30)
    body = json.dumps({"prompt": "x" * 400, "max_tokens": 1}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body))
        assert closed_while_dribbling(s, body, 30)
    # A request sent at once is served, on a connection kept alive across two.
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        for _ in range(2):
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert s.recv(4096).startswith(b"HTTP/1.1 200")


def test_a_chunked_body_over_the_limit_is_refused_once_sent(server_factory):
    # No Content-Length to refuse from: the body is counted as it arrives,
    # dropped (never held) once it passes max_message_mb, and the client,
    # which sends it all before reading, reads the 413.
    server = server_factory("http_chunked", [("demo-lm", DEMO_LM, "")],
                            http=True, metrics=False, extra="max_message_mb: 1")
    chunk = b"x" * 65536
    body = (b"%x\r\n%s\r\n" % (len(chunk), chunk)) * 24 + b"0\r\n\r\n"
    status, answer, _ = raw(server.http_port,
                            "POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                            "Transfer-Encoding: chunked", body=body)
    assert status == 413, answer
    assert "max_message_mb" in answer["error"]["message"]
    # A chunked body within the limit is served.
    request = json.dumps({"prompt": "x", "max_tokens": 2}).encode()
    status, answer, _ = raw(server.http_port,
                            "POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                            "Transfer-Encoding: chunked",
                            body=b"%x\r\n%s\r\n0\r\n\r\n" % (len(request), request))
    assert status == 200, answer
