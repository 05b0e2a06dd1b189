"""The ratio ceiling through the real server (issue 30, item 3).

The query-norm fixture LM has the MoH-LLaMA3-8B layout in small: 8 heads,
2 KV heads, shared heads 0-3 = KV head 0. A request at ratio 0.5 routes no
head (K = 0 in every layer) and never can (adaptive activation only
lowers), so it stores only KV head 0: a block holds twice its positions,
and twice the sequences fit the same kv_blocks. Observed on the server's
own gauges (moh_requests_running / moh_requests_waiting), never by timing.
Its outputs are those of the independent reference (golden.json), alone or
beside wide rows, with prompt chunks, prefix-cache hits and n > 1."""
import concurrent.futures
import json
import os
import shutil
import threading

import pytest

import moh_testlib as lib

QNORM_DIR = os.path.join(lib.FIXTURES, "llama_qnorm")
LONG_POSITIONS = 4096
BLOCK = 16
# Two whole sequences at full width: 2 x 4096 positions.
KV_BLOCKS = 2 * LONG_POSITIONS // BLOCK


def make_long_qnorm(dst_dir):
    """The query-norm fixture with 4096 positions (RoPE tables are built at
    load: only config.json changes)."""
    shutil.copytree(QNORM_DIR, dst_dir, dirs_exist_ok=True)
    path = os.path.join(dst_dir, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["max_position_embeddings"] = LONG_POSITIONS
    with open(path, "w") as f:
        json.dump(config, f)
    return dst_dir


@pytest.fixture(scope="module")
def golden():
    with open(os.path.join(QNORM_DIR, "golden.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def server(start_server, workdir):
    long_dir = make_long_qnorm(os.path.join(workdir, "llama_qnorm_long"))
    return start_server("ratio_ceiling", [
        ("long", long_dir,
         "generation { max_running: 8 max_seq_len: %d kv_block_size: %d "
         "kv_blocks: %d }" % (LONG_POSITIONS, BLOCK, KV_BLOCKS)),
        # Small blocks, prompt chunks of 3 tokens: narrow rows beside wide
        # ones, chunked, reading cached prefixes.
        ("mixed", QNORM_DIR,
         "generation { max_running: 16 kv_block_size: 2 "
         "prefill_token_budget: 3 }"),
    ], wait_serving=False)


stub, models = lib.model_fixtures()


def gauges(server, model):
    samples = server.samples()
    return (lib.metric_value(samples, "moh_requests_running", model=model),
            lib.metric_value(samples, "moh_requests_waiting", model=model))


def test_the_log_states_the_narrow_width(api, server, models):
    assert models["long"].state == api.pb.ModelInfo.READY
    lib.wait_until(lambda: "narrow KV width 1 of 2" in server.log(), 30,
                   "the ratio ceiling's log line")


def admitted_at_once(api, server, stub, ratios, expected):
    """Starts a request at each of `ratios` (in this order) that would fill
    a whole sequence (thousands of steps each), waits until the server's gauges read
    `expected` (running, waiting), checking that no more ever run, then
    cancels them all."""
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    calls = []
    for ratio in ratios:
        request = lib.generate_request(
            api.pb, model="long", token_ids=prompt, ratio=ratio,
            max_new_tokens=LONG_POSITIONS - len(prompt), ignore_eos=True)
        calls.append(stub.Generate(request, timeout=lib.RPC_TIMEOUT))
    readers = []
    for call in calls:
        reader = threading.Thread(target=lambda c=call: _drain(c), daemon=True)
        reader.start()
        readers.append(reader)
    seen = []

    def steady():
        seen.append(gauges(server, "long"))
        return seen[-1] == expected

    try:
        lib.wait_until(steady, 60, "%s (running, waiting)" % (expected,))
        assert max(running for running, _ in seen) == expected[0], seen
    finally:
        for call in calls:
            call.cancel()
        for reader in readers:
            reader.join(lib.RPC_TIMEOUT)
        lib.wait_until(lambda: gauges(server, "long") == (0, 0), 60,
                       "an idle server")


def _drain(call):
    try:
        for _ in call:
            pass
    except Exception:  # cancelled
        pass


def test_ratio_half_admits_twice_the_sequences(api, server, stub, models):
    # Each request can fill 4096 positions. At ratio 1.0 two fit the
    # 512 blocks of 16; at 0.5 (K = 0: half-width blocks) four do.
    assert gauges(server, "long") == (0, 0)
    admitted_at_once(api, server, stub, [1.0] * 4, expected=(2, 2))
    admitted_at_once(api, server, stub, [0.5] * 4, expected=(4, 0))
    admitted_at_once(api, server, stub, [0.5] * 6, expected=(4, 2))
    # Beside each other: a wide request (0.75 routes 2 heads) takes the
    # room of two narrow ones.
    admitted_at_once(api, server, stub, [0.75, 0.5, 0.5, 0.5],
                     expected=(3, 1))


def generate(api, stub, ratio, prompt, n=1):
    request = lib.generate_request(
        api.pb, model="mixed", token_ids=prompt, ratio=ratio,
        max_new_tokens=8, temperature=0.0)
    request.n = n
    messages = lib.run_generate(stub, request)
    assert messages[-1].finish_reason == api.pb.LENGTH
    if n == 1:
        return lib.token_ids_of(messages)
    samples = [[] for _ in range(n)]
    for m in messages:
        samples[m.index].extend(m.token_ids)
    return samples


def test_outputs_equal_the_reference_at_once_and_one_at_a_time(
        api, stub, models, golden):
    cases = [c for c in golden["cases"] if c["ratio"] in (0.5, 1.0, 0.75)]
    assert any(c["ratio"] == 0.5 for c in cases)
    prompts = golden["prompts"]
    # Each case twice (the second reads the first's cached blocks, or
    # computes beside it), all at once: narrow rows beside wide ones.
    jobs = [(c["ratio"], prompts[c["prompt"]], c["greedy"]) for c in cases] * 2
    alone = [generate(api, stub, ratio, prompt) for ratio, prompt, _ in jobs]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(lambda j: generate(api, stub, j[0], j[1]),
                                 jobs))
    for (ratio, prompt, greedy), a, t in zip(jobs, alone, together):
        assert a == greedy, (ratio, prompt)
        assert t == greedy, (ratio, prompt)
    # n > 1 at ratio 0.5: the samples share the narrow prompt blocks.
    for c in cases:
        if c["ratio"] == 0.5:
            assert generate(api, stub, 0.5, prompts[c["prompt"]], n=3) == \
                [c["greedy"]] * 3
