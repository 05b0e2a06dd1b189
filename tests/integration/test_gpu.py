"""GPU suite, through the real moh-server (`ctest -L gpu`; also collected by
the integration suite). Skipped, saying so, when moh-server sees no CUDA
device (`moh-server --version`): every CPU-only machine, and CUDA builds
without a GPU, such as this project's CI.

The same fixture LM is served twice, on cuda (bf16, the default there) and on
cpu (fp32), and asked the same streamed, greedy requests at several ratios."""
import re
import subprocess

import grpc
import pytest

import moh_testlib as lib


def visible_gpus():
    out = subprocess.run([lib.SERVER, "--version"], capture_output=True,
                         text=True, timeout=120).stdout
    match = re.search(r"(\d+) GPUs? visible", out)
    return int(match.group(1)) if match else 0


pytestmark = pytest.mark.skipif(
    visible_gpus() == 0, reason="no CUDA device visible to moh-server")


@pytest.fixture(scope="module")
def gpu_server(start_server, api):
    return start_server("gpu", [
        ("lm-cuda", lib.LM_DIR, 'device: "cuda" generation { max_running: 4 }'),
        ("lm-cpu", lib.LM_DIR, 'device: "cpu" generation { max_running: 4 }'),
        ("vit-cuda", lib.VIT_DIR, 'device: "cuda"'),
        # Every kernel path of this project switched off (the operator's
        # fallbacks): the ATen and cuBLAS paths before them.
        ("lm-cuda-fallbacks", lib.LM_DIR,
         'device: "cuda" generation { max_running: 4 cuda_paths { '
         'paged_decode: false fused_ops: false varlen_prefill: false '
         'skinny_linear: false } }'),
    ])


def test_models_report_cuda_and_bfloat16(gpu_server, api):
    stub = api.grpc.InferenceStub(gpu_server.channel())
    models = {m.name: m for m in stub.ListModels(
        api.pb.ListModelsRequest(), timeout=lib.RPC_TIMEOUT).models}
    assert models["lm-cuda"].device.startswith("cuda")
    assert models["lm-cuda"].dtype == "bfloat16"
    assert models["lm-cpu"].device == "cpu"


@pytest.mark.parametrize("ratio", [0.5, 0.0, 0.75, 1.0])
def test_streamed_generation_on_cuda_matches_cpu(gpu_server, api, ratio):
    stub = api.grpc.InferenceStub(gpu_server.channel())
    results = {}
    for model in ("lm-cuda", "lm-cuda-fallbacks", "lm-cpu"):
        request = lib.generate_request(api.pb, token_ids=[5, 9, 17, 33],
                                       model=model, ratio=ratio,
                                       max_new_tokens=12)
        messages = lib.run_generate(stub, request)
        assert len(messages) > 1, "not streamed"
        results[model] = messages
    cpu = results["lm-cpu"]
    for model in ("lm-cuda", "lm-cuda-fallbacks"):
        cuda = results[model]
        assert cuda[-1].usage.completion_tokens == 12, model
        # K per token is fixed by the ratio: the fraction of (token, head)
        # pairs computed is the same whatever bf16 rounding does to the
        # selections.
        assert cuda[-1].effective_activation_ratio == pytest.approx(
            cpu[-1].effective_activation_ratio, abs=1e-6), model
        # bf16 greedy decoding follows fp32 until a near tie: the first
        # tokens agree.
        assert lib.token_ids_of(cuda)[:2] == lib.token_ids_of(cpu)[:2], model


def test_mixed_ratios_in_one_cuda_batch(gpu_server, api):
    stub = api.grpc.InferenceStub(gpu_server.channel())
    calls = [stub.Generate(lib.generate_request(
        api.pb, token_ids=[3, 4, 5], model="lm-cuda", ratio=r,
        max_new_tokens=16), timeout=lib.RPC_TIMEOUT)
             for r in (0.5, 0.75, 1.0, 0.0)]
    for call in calls:
        messages = lib.drain_stream(call, lib.RPC_TIMEOUT)
        assert messages[-1].usage.completion_tokens == 16


def test_gpu_memory_metric(gpu_server, api):
    samples = gpu_server.samples()
    used = lib.metric_value(samples, "moh_gpu_memory_bytes", device="cuda:0")
    assert used is not None and used > 0
    # No gpu_memory_fraction: the whole device (16 GB and more on the cards
    # this project is lent).
    limit = lib.metric_value(samples, "moh_gpu_memory_limit_bytes",
                             device="cuda:0")
    assert limit is not None and limit > max(used, 16e9)


def test_cuda_graph_replays_metric(gpu_server, api):
    """A single stream's decode steps share one shape: after the first (eager)
    and the second (recorded), they replay as a CUDA graph, which
    moh_cuda_graph_replays_total counts per model; the CPU model never
    replays."""
    stub = api.grpc.InferenceStub(gpu_server.channel())
    def replays(samples, model):
        return [v for _, v in lib.metric_series(
            samples, "moh_cuda_graph_replays_total", model=model)]

    before = replays(gpu_server.samples(), "lm-cuda")
    lib.run_generate(stub, lib.generate_request(
        api.pb, token_ids=[7, 8, 9], model="lm-cuda", ratio=1.0,
        max_new_tokens=12))
    samples = gpu_server.samples()
    after = replays(samples, "lm-cuda")
    assert len(before) == 1 and len(after) == 1
    assert after[0] > before[0]
    assert replays(samples, "lm-cpu") == [0]


def test_a_real_device_fault_fails_its_model_and_the_health(server_factory,
                                                             api):
    """A CUDA context lost for real: $MOH_TEST_DEVICE_FAULT_AT_STEP=1 makes
    lm-cuda's first decode step launch a gather whose index is out of range,
    which fails a device-side assertion (a sticky error; the CPU model's
    steps run as ever). DeviceLost's CUDA side (one cudaDeviceSynchronize,
    the sticky errors' list) reads it: the stream ends UNAVAILABLE naming the
    loss, lm-cuda is FAILED, the server NOT_SERVING; the CPU model and the
    metrics keep answering, and SIGTERM still ends the process cleanly.
    (test_lifecycle.py checks the same on the CPU through a simulated
    loss.)"""
    server = server_factory("device_fault", [
        ("lm-cuda", lib.LM_DIR, 'device: "cuda" generation { max_running: 4 }'),
        ("lm-cpu", lib.LM_DIR, 'device: "cpu" generation { max_running: 4 }'),
    ], env={"MOH_TEST_DEVICE_FAULT_AT_STEP": "1"})
    stub = api.grpc.InferenceStub(server.channel())
    request = lib.generate_request(api.pb, model="lm-cuda",
                                   token_ids=[5, 9, 17], max_new_tokens=8)
    tokens, error = lib.stream_until_error(stub, request)
    assert error.code() == grpc.StatusCode.UNAVAILABLE, error
    assert error.details().startswith("model 'lm-cuda': cuda:0 lost: "), (
        error.details())
    assert "the process must restart" in error.details()
    models = {m.name: m for m in stub.ListModels(
        api.pb.ListModelsRequest(), timeout=lib.RPC_TIMEOUT).models}
    assert models["lm-cuda"].state == api.pb.ModelInfo.FAILED
    assert "lost" in models["lm-cuda"].failure_reason
    assert models["lm-cpu"].state == api.pb.ModelInfo.READY
    lib.wait_until(lambda: lib.health_check(server.channel()) == "NOT_SERVING",
                   10, "NOT_SERVING after the loss")
    # The CPU model still generates; the metrics still scrape.
    messages = lib.run_generate(stub, lib.generate_request(
        api.pb, model="lm-cpu", token_ids=[5, 9, 17], max_new_tokens=4))
    assert messages[-1].usage.completion_tokens == 4
    assert lib.metric_value(server.samples(),
                            "process_resident_memory_bytes") is not None
    # The prompt's step gave one token; the first decode step failed.
    assert len(tokens) == 1, tokens
    assert server.terminate_and_wait() == 0, server.log()[-3000:]


def test_gpu_memory_fraction_caps_what_a_model_may_hold(server_factory, api):
    """gpu_memory_fraction: 0.01 (a GPU shared with other processes) caps
    LibTorch's caching allocator at 1% of the device (0.8 GB on an H100, 1.4
    on an H200). A model whose KV cache (65,536 blocks of 256 positions at
    256 bytes each: 4 GiB) would not fit that share is FAILED at load, the
    share named; one whose cache fits loads and generates as on the whole
    device."""
    server = server_factory("memory_fraction", [
        ("lm-fits", lib.LM_DIR, 'device: "cuda" generation { max_running: 4 }'),
        ("lm-too-big", lib.LM_DIR,
         'device: "cuda" generation { kv_blocks: 65536 kv_block_size: 256 }'),
    ], extra="gpu_memory_fraction: 0.01", wait_serving=False)
    models = lib.wait_models_loaded(api, server)
    assert models["lm-fits"].state == api.pb.ModelInfo.READY
    assert models["lm-too-big"].state == api.pb.ModelInfo.FAILED
    reason = models["lm-too-big"].failure_reason
    share = re.search(r"exceed 90% of its (\d+\.\d+) GiB", reason)
    assert share, reason
    assert 0.5 < float(share.group(1)) < 2.0, reason  # 1% of 80-192 GB
    limit = lib.metric_value(server.samples(), "moh_gpu_memory_limit_bytes",
                             device="cuda:0")
    assert limit == pytest.approx(float(share.group(1)) * 2**30, rel=0.01)
    assert "at most 0.01 of its memory (gpu_memory_fraction)" in server.log()
    stub = api.grpc.InferenceStub(server.channel())
    messages = lib.run_generate(stub, lib.generate_request(
        api.pb, model="lm-fits", token_ids=[5, 9, 17], max_new_tokens=8))
    assert messages[-1].usage.completion_tokens == 8
