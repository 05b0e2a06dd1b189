"""The paged KV cache and prompt prefix sharing through the real server.

A prompt's whole KV blocks are kept once computed; a later request whose
prompt starts the same way at the same activation reads them instead of
computing them (moh_prefix_cache_hits_total) and generates exactly what a
server without sharing generates. At another activation nothing is shared:
keys and values of every layer after the first depend on the heads the
earlier layers routed. Requests whose blocks do not fit wait for them and
all finish; a cache too small for one sequence fails its model only."""
import concurrent.futures

import pytest

import moh_testlib as lib

PROMPT = ("Once upon a time there was a little girl who lived in a small "
          "house near the big forest with her mother")
BLOCK = 4


@pytest.fixture(scope="module")
def server(start_server):
    return start_server("prefix_cache", [
        ("shared", lib.LM_DIR,
         "generation { max_running: 4 kv_block_size: %d }" % BLOCK),
        ("private", lib.LM_DIR,
         "generation { max_running: 4 kv_block_size: %d "
         "prefix_caching: false }" % BLOCK),
        # One 64-token sequence fits, so requests of 40 positions (5 blocks)
        # run one at a time.
        ("tight", lib.LM_DIR,
         "generation { max_running: 4 max_seq_len: 64 kv_block_size: 8 "
         "kv_blocks: 8 }"),
        ("too_small", lib.LM_DIR,
         "generation { max_seq_len: 64 kv_block_size: 8 kv_blocks: 7 }"),
    ], wait_serving=False)


stub, models = lib.model_fixtures()


def prefix_counters(server, model):
    samples = server.samples()
    return (lib.metric_value(samples, "moh_prefix_cache_queries_total",
                             model=model),
            lib.metric_value(samples, "moh_prefix_cache_hits_total",
                             model=model))


def generate(api, stub, model, ratio, prompt=PROMPT, max_new_tokens=16):
    messages = lib.run_generate(stub, lib.generate_request(
        api.pb, model=model, prompt=prompt, ratio=ratio,
        max_new_tokens=max_new_tokens))
    assert messages[-1].finish_reason == api.pb.LENGTH
    return lib.token_ids_of(messages), messages[-1].usage.prompt_tokens


def test_list_models_describes_the_cache(api, models):
    shared, private, tight = models["shared"], models["private"], models["tight"]
    assert (shared.kv_block_size, shared.prefix_caching) == (BLOCK, True)
    assert (private.kv_block_size, private.prefix_caching) == (BLOCK, False)
    # By default, blocks for max_running (4) sequences of max_seq_len.
    assert shared.kv_blocks == 4 * -(-shared.max_seq_len // BLOCK)
    assert (tight.kv_block_size, tight.kv_blocks) == (8, 8)


def test_a_repeated_prompt_reads_its_cached_prefix(api, stub, server,
                                                   models):
    assert models["shared"].state == api.pb.ModelInfo.READY
    want, prompt_tokens = generate(api, stub, "private", 0.5)
    assert prompt_tokens > 2 * BLOCK
    queries, hits = prefix_counters(server, "shared")
    first, _ = generate(api, stub, "shared", 0.5)
    after_first = prefix_counters(server, "shared")
    assert after_first == (queries + prompt_tokens, hits)
    second, _ = generate(api, stub, "shared", 0.5)
    after_second = prefix_counters(server, "shared")
    # Every whole block but the one holding the prompt's last token.
    shared = (prompt_tokens - 1) // BLOCK * BLOCK
    assert after_second == (after_first[0] + prompt_tokens,
                            after_first[1] + shared)
    assert first == want and second == want
    assert lib.metric_value(server.samples(), "moh_prefix_cache_queries_total",
                            model="private") == 0


def test_another_ratio_computes_its_own_prefix(api, stub, server, models):
    generate(api, stub, "shared", 0.5)  # cached at 0.5
    want, _ = generate(api, stub, "private", 1.0)
    _, hits = prefix_counters(server, "shared")
    got, _ = generate(api, stub, "shared", 1.0)
    assert prefix_counters(server, "shared")[1] == hits
    assert got == want
    # ... which the next request at 1.0 reads.
    again, _ = generate(api, stub, "shared", 1.0)
    assert prefix_counters(server, "shared")[1] > hits
    assert again == want


def test_a_longer_prompt_reads_the_shorter_ones_blocks(api, stub, server,
                                                       models):
    longer = PROMPT + " and her little dog"
    want, _ = generate(api, stub, "private", 0.5, prompt=longer)
    generate(api, stub, "shared", 0.5)
    _, hits = prefix_counters(server, "shared")
    got, _ = generate(api, stub, "shared", 0.5, prompt=longer)
    assert prefix_counters(server, "shared")[1] > hits
    assert got == want


def test_the_next_turn_reads_the_blocks_of_generated_tokens(
        api, stub, server, models):
    # A conversation: the second request's prompt is the first's prompt and
    # answer and more. Blocks whose keys and values were computed while
    # generating are read too, and the answer equals a server's without
    # sharing.
    first = list(range(40, 50))
    request = lib.generate_request(api.pb, model="shared", token_ids=first,
                                   ratio=0.5, max_new_tokens=12)
    answer = lib.token_ids_of(lib.run_generate(stub, request))
    turn = first + answer + [60, 61, 62]
    want = lib.token_ids_of(lib.run_generate(stub, lib.generate_request(
        api.pb, model="private", token_ids=turn, ratio=0.5,
        max_new_tokens=8)))
    _, hits = prefix_counters(server, "shared")
    got = lib.token_ids_of(lib.run_generate(stub, lib.generate_request(
        api.pb, model="shared", token_ids=turn, ratio=0.5, max_new_tokens=8)))
    # Computed: the prompt and every answer token but the last.
    computed = len(first) + len(answer) - 1
    assert prefix_counters(server, "shared")[1] - hits == \
        computed // BLOCK * BLOCK
    assert got == want


def test_requests_wait_for_blocks_and_all_finish(api, stub, server, models):
    assert models["tight"].state == api.pb.ModelInfo.READY
    prompts = ["Once upon a time", "The little dog", "A girl and her mother",
               "In the forest there"]
    want = [generate(api, stub, "private", 0.0, prompt=p,
                     max_new_tokens=30)[0] for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(
            lambda p: generate(api, stub, "tight", 0.0, prompt=p,
                               max_new_tokens=30)[0], prompts))
    assert got == want
    samples = server.samples()
    assert lib.metric_value(samples, "moh_kv_blocks_in_use",
                            model="tight") == 0
    assert lib.metric_value(samples, "moh_kv_cache_usage_ratio",
                            model="tight") == 0
    assert lib.metric_value(samples, "moh_kv_blocks_cached",
                            model="tight") > 0


def test_a_cache_too_small_for_one_sequence_fails_its_model_only(
        api, stub, server, models):
    assert server.proc.poll() is None, server.log()
    bad = models["too_small"]
    assert bad.state == api.pb.ModelInfo.FAILED
    assert "kv_blocks must be in [8," in bad.failure_reason, bad.failure_reason
    assert "got 7" in bad.failure_reason
    generate(api, stub, "shared", 0.0)


def samples_by_index(messages):
    """{index: (token ids, last message)} of a stream with n samples."""
    out = {}
    for m in messages:
        ids, _ = out.get(m.index, ([], None))
        out[m.index] = (ids + list(m.token_ids), m)
    return out


def test_n_samples_share_one_prefill(api, stub, server, models):
    # Three seeded samples in one request: sample i is what a request alone
    # with seed + i generates; the first computes the prompt, the others
    # read its whole blocks (a prompt no request has sent before).
    prompt = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    wants = [lib.token_ids_of(lib.run_generate(stub, lib.generate_request(
        api.pb, model="private", token_ids=prompt, ratio=0.5,
        max_new_tokens=10, temperature=1.0, seed=100 + i))) for i in range(3)]
    assert len({tuple(w) for w in wants}) > 1  # the seeds differ
    _, hits = prefix_counters(server, "shared")
    request = lib.generate_request(api.pb, model="shared", token_ids=prompt,
                                   ratio=0.5, max_new_tokens=10,
                                   temperature=1.0, seed=100)
    request.n = 3
    messages = lib.run_generate(stub, request)
    samples = samples_by_index(messages)
    assert sorted(samples) == [0, 1, 2]
    for i, want in enumerate(wants):
        ids, last = samples[i]
        assert ids == want, i
        assert last.finish_reason == api.pb.LENGTH
        assert last.usage.completion_tokens == 10
        assert last.usage.prompt_tokens == len(prompt)
    # Each sample's last message ends it; the stream ends after all three.
    finished = [m.index for m in messages if m.finish_reason]
    assert sorted(finished) == [0, 1, 2]
    shared = (len(prompt) - 1) // BLOCK * BLOCK
    assert prefix_counters(server, "shared")[1] - hits == 2 * shared


def test_n_samples_without_prefix_caching_compute_their_own(api, stub,
                                                            server, models):
    request = lib.generate_request(api.pb, model="private", prompt=PROMPT,
                                   ratio=0.5, max_new_tokens=6,
                                   temperature=0.0)
    request.n = 2
    samples = samples_by_index(lib.run_generate(stub, request))
    want, _ = generate(api, stub, "private", 0.5, max_new_tokens=6)
    assert samples[0][0] == want and samples[1][0] == want
    for bad, message in ((17, "n must be in [1, 16], got 17"),
                         (-1, "n must be in [1, 16], got -1")):
        request.n = bad
        error = lib.rpc_error(stub.Generate, request, timeout=lib.RPC_TIMEOUT)
        assert error.code().name == "INVALID_ARGUMENT"
        assert message in error.details()
