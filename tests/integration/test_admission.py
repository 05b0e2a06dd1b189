"""Cancellation, deadlines and queue limits on a server with ONE generation
slot (max_running 1) and room for two waiting requests (max_queued_requests 2).

A long request (the "occupant", thousands of greedy tokens of the fixture LM
patched never to end with EOS) holds the slot, so whatever comes next waits.
Whether something was computed is read from the server's own counters.
"""
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

import moh_testlib as lib

MODEL = "long"
OCCUPANT_TOKENS = 8000  # + 14 prompt tokens <= max_seq_len 8192
# Tokens of each request queued behind it in the priority test: long enough
# that one request's whole generation separates the two streams' starts.
QUEUED_TOKENS = 400


@pytest.fixture(scope="module")
def server(start_server, long_lm_dir):
    return start_server("one_slot", [
        (MODEL, long_lm_dir,
         "generation { max_running: 1 max_queued_requests: 2 "
         "max_seq_len: 8192 }"),
    ])


@pytest.fixture(scope="module")
def stub(server, api):
    return api.grpc.InferenceStub(server.channel())


def gauges(server):
    samples = server.samples()
    return (lib.metric_value(samples, "moh_requests_running", model=MODEL),
            lib.metric_value(samples, "moh_requests_waiting", model=MODEL))


@pytest.fixture(autouse=True)
def idle_server(server):
    """Each test starts and ends with nothing running or waiting."""
    lib.wait_until(lambda: gauges(server) == (0, 0), 60, "an idle server")
    yield
    lib.wait_until(lambda: gauges(server) == (0, 0), 60, "an idle server")


def counter(server, name, **labels):
    return lib.metric_value(server.samples(), name, model=MODEL, **labels)


def occupant_request(api, max_new_tokens=OCCUPANT_TOKENS):
    return lib.generate_request(api.pb, model=MODEL, prompt="Once upon a time",
                                max_new_tokens=max_new_tokens)


def test_cancel_mid_stream_frees_the_slot(api, server, stub):
    running_before, _ = gauges(server)
    generated_before = counter(server, "moh_generated_tokens_total")
    cancelled_before = counter(server, "moh_requests_total", rpc="Generate",
                               code="CANCELLED")
    call = stub.Generate(occupant_request(api), timeout=lib.RPC_TIMEOUT)
    received = [next(call) for _ in range(3)]
    assert all(m.token_ids for m in received)
    assert gauges(server)[0] == running_before + 1
    call.cancel()
    with pytest.raises(grpc.RpcError) as error:
        list(call)
    assert error.value.code() == grpc.StatusCode.CANCELLED
    # The slot is freed: the running gauge is back where it was ...
    lib.wait_until(lambda: gauges(server)[0] == running_before, 30,
                   "moh_requests_running back to %d" % running_before)
    lib.wait_until(
        lambda: counter(server, "moh_requests_total", rpc="Generate",
                        code="CANCELLED") == cancelled_before + 1, 30,
        "moh_requests_total{code=CANCELLED} + 1")
    # ... the work stopped early ...
    generated = counter(server, "moh_generated_tokens_total") - generated_before
    assert 3 <= generated < OCCUPANT_TOKENS
    # ... and the one slot serves the next request.
    messages = lib.run_generate(stub, occupant_request(api, 5))
    assert messages[-1].finish_reason == api.pb.LENGTH
    assert messages[-1].usage.completion_tokens == 5
    # On the CPU no step is a recorded CUDA graph; the series is exported.
    assert [v for _, v in lib.metric_series(
        server.samples(), "moh_cuda_graph_replays_total", model=MODEL)] == [0]


def test_cancel_while_queued(api, server, stub):
    occupant = lib.Occupant(stub, occupant_request(api))
    queued = stub.Generate(occupant_request(api, 5), timeout=lib.RPC_TIMEOUT)
    lib.wait_until(lambda: gauges(server) == (1, 1), 30, "one waiting request")
    queued.cancel()
    lib.wait_until(lambda: gauges(server)[1] == 0, 30,
                   "moh_requests_waiting back to 0")
    with pytest.raises(grpc.RpcError) as error:
        list(queued)
    assert error.value.code() == grpc.StatusCode.CANCELLED
    assert not occupant.done.is_set(), "occupant too short to test this"
    messages = occupant.join()
    assert occupant.error is None
    assert messages[-1].finish_reason == api.pb.LENGTH
    assert messages[-1].usage.completion_tokens == OCCUPANT_TOKENS


def test_deadline_passing_in_the_queue_is_never_computed(api, server, stub):
    generated_before = counter(server, "moh_generated_tokens_total")
    prompt_before = counter(server, "moh_prompt_tokens_total")
    occupant = lib.Occupant(stub, occupant_request(api))
    # Waits behind the occupant; its 0.2 s deadline passes in the queue.
    short = lib.generate_request(api.pb, model=MODEL, prompt="hi",
                                 max_new_tokens=4)
    error = lib.rpc_error(lib.run_generate, stub, short, timeout=0.2)
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED, error
    assert not occupant.done.is_set(), (
        "the occupant finished before the short deadline: it did not keep "
        "the slot busy, so this test proves nothing")
    messages = occupant.join()
    assert occupant.error is None, occupant.error
    last = messages[-1]
    assert last.finish_reason == api.pb.LENGTH
    assert last.usage.completion_tokens == OCCUPANT_TOKENS
    # Only the occupant was computed.
    lib.wait_until(
        lambda: counter(server, "moh_generated_tokens_total") -
        generated_before >= OCCUPANT_TOKENS, 30, "the occupant's tokens")
    assert (counter(server, "moh_generated_tokens_total") - generated_before
            == OCCUPANT_TOKENS)
    assert (counter(server, "moh_prompt_tokens_total") - prompt_before ==
            last.usage.prompt_tokens)


def test_zero_deadline_gets_deadline_exceeded(api, server, stub):
    # gRPC carries deadlines with millisecond resolution, so a deadline "now"
    # may reach the server as up to 1 ms ahead, and a step may run in it:
    # "never computed" is checked on a queued request above, not here.
    ok_before = counter(server, "moh_requests_total", rpc="Generate", code="OK")
    # Long enough that none can finish in the millisecond a deadline "now"
    # may leave it (the fixture decodes a token in a fraction of one).
    expiring = lib.generate_request(api.pb, model=MODEL, prompt="hi",
                                    max_new_tokens=1000)
    request = lib.generate_request(api.pb, model=MODEL, prompt="hi",
                                   max_new_tokens=4)
    for _ in range(3):
        error = lib.rpc_error(lib.run_generate, stub, expiring, timeout=0.0)
        assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED, error
    # The client gives up at once; the requests may or may not have been
    # sent, and the server needs a moment to drop those that were (until
    # then they hold the slot and the queue: RESOURCE_EXHAUSTED is right for
    # a request arriving meanwhile).
    for attempt in range(5):
        lib.wait_until(lambda: gauges(server) == (0, 0), 30, "an idle server")
        try:
            messages = lib.run_generate(stub, request)
            break
        except grpc.RpcError as e:
            if (e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or
                    attempt == 4):
                raise
    assert messages[-1].usage.completion_tokens == 4
    lib.wait_until(
        lambda: counter(server, "moh_requests_total", rpc="Generate",
                        code="OK") >= ok_before + 1, 30, "the OK request")
    assert counter(server, "moh_requests_total", rpc="Generate",
                   code="OK") == ok_before + 1


def test_burst_beyond_the_queue_is_rejected_at_once(api, server, stub):
    exhausted_before = counter(server, "moh_requests_total", rpc="Generate",
                               code="RESOURCE_EXHAUSTED")
    occupant = lib.Occupant(stub, occupant_request(api))
    burst = 6
    barrier = threading.Barrier(burst, timeout=30)
    request = lib.generate_request(api.pb, model=MODEL, prompt="hi",
                                   max_new_tokens=4)

    def one(_):
        barrier.wait()
        try:
            return ("OK", lib.run_generate(stub, request), None)
        except grpc.RpcError as e:
            # Rejected before the occupant (thousands of steps) is done.
            return (e.code().name, e.details(), occupant.done.is_set())

    with ThreadPoolExecutor(burst) as pool:
        results = list(pool.map(one, range(burst)))
    codes = sorted(r[0] for r in results)
    assert codes == ["OK"] * 2 + ["RESOURCE_EXHAUSTED"] * (burst - 2), results
    for code, detail, occupant_done in results:
        if code == "OK":
            assert detail[-1].finish_reason == api.pb.LENGTH
            assert detail[-1].usage.completion_tokens == 4
        else:
            assert "max_queued_requests" in detail, detail
            assert occupant_done is False, "rejected only after the occupant"
    messages = occupant.join()
    assert messages[-1].finish_reason == api.pb.LENGTH
    assert messages[-1].usage.completion_tokens == OCCUPANT_TOKENS
    assert (counter(server, "moh_requests_total", rpc="Generate",
                    code="RESOURCE_EXHAUSTED") == exhausted_before + burst - 2)


def test_a_stream_past_its_deadline_counts_as_deadline_exceeded(
        api, server, stub):
    # gRPC cancels the call at its deadline; the server counts an expiry,
    # not a client cancellation.
    expired_before = counter(server, "moh_requests_total", rpc="Generate",
                             code="DEADLINE_EXCEEDED")
    cancelled_before = counter(server, "moh_requests_total", rpc="Generate",
                               code="CANCELLED")
    start = time.monotonic()
    list(stub.Generate(occupant_request(api), timeout=lib.RPC_TIMEOUT))
    whole = time.monotonic() - start
    # A deadline at a tenth of what the whole stream takes passes mid-stream.
    call = stub.Generate(occupant_request(api), timeout=whole / 10)
    with pytest.raises(grpc.RpcError) as error:
        list(call)
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    lib.wait_until(
        lambda: counter(server, "moh_requests_total", rpc="Generate",
                        code="DEADLINE_EXCEEDED") == expired_before + 1, 30,
        "moh_requests_total{code=DEADLINE_EXCEEDED} + 1")
    assert counter(server, "moh_requests_total", rpc="Generate",
                   code="CANCELLED") == cancelled_before


def test_higher_priority_is_admitted_first(api, server, stub):
    # Behind the occupant wait a request of priority 0, then one of priority
    # 5: the slot, once free, goes to the later, higher one, which generates
    # all its tokens before the other's first (one slot). Compared by when
    # each stream's first message arrived: the other's comes a whole
    # generation later.
    occupant = lib.Occupant(stub, occupant_request(api))
    first_message, finish = {}, {}

    def queue(priority):
        request = occupant_request(api, QUEUED_TOKENS)
        request.priority = priority
        call = stub.Generate(request, timeout=lib.RPC_TIMEOUT)

        def read():
            messages = []
            for m in call:
                first_message.setdefault(priority, time.monotonic())
                messages.append(m)
            finish[priority] = messages[-1].finish_reason
        thread = threading.Thread(target=read)
        thread.start()
        return thread

    low = queue(0)
    lib.wait_until(lambda: gauges(server) == (1, 1), 30, "one waiting request")
    high = queue(5)
    lib.wait_until(lambda: gauges(server) == (1, 2), 30, "two waiting requests")
    assert not occupant.done.is_set(), "occupant too short to test this"
    occupant.call.cancel()
    low.join(lib.RPC_TIMEOUT)
    high.join(lib.RPC_TIMEOUT)
    occupant.join()
    assert sorted(first_message, key=first_message.get) == [5, 0]
    assert finish == {5: api.pb.LENGTH, 0: api.pb.LENGTH}
