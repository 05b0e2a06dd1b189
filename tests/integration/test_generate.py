"""Generate over the wire equals the independent reference's greedy generation.

The goldens (tests/reference, make_fixtures.py) hold, for each prompt and
activation ratio, the 8 tokens greedy decoding produces in the Python reference
model, and the effective activation ratio it computed.
"""
import json
import math
import os
import subprocess
import time

import grpc
import pytest

import moh_testlib as lib

with open(os.path.join(lib.FIXTURES, "llama_learned", "golden.json")) as f:
    _GOLDEN = json.load(f)
CASES = _GOLDEN["cases"]
CASE_IDS = ["ratio%g-prompt%d" % (c["ratio"], c["prompt"]) for c in CASES]


def golden_request(api, case, include_routing=True):
    return lib.generate_request(api.pb,
                                token_ids=_GOLDEN["prompts"][case["prompt"]],
                                max_new_tokens=_GOLDEN["new_tokens"],
                                temperature=0.0,
                                ratio=case["ratio"],
                                include_routing=include_routing)


def check_golden_stream(api, case, messages):
    prompt = _GOLDEN["prompts"][case["prompt"]]
    assert messages, "empty stream"
    last = messages[-1]
    for m in messages[:-1]:
        assert m.finish_reason == api.pb.FINISH_REASON_UNSPECIFIED, m
    assert lib.token_ids_of(messages) == case["greedy"]
    # The goldens never reach EOS within 8 tokens.
    assert last.finish_reason == api.pb.LENGTH, last
    assert last.usage.prompt_tokens == len(prompt)
    assert last.usage.completion_tokens == _GOLDEN["new_tokens"]
    assert last.effective_activation_ratio == pytest.approx(
        case["effective_ratio"], abs=1e-5)
    if case["ratio"] == 0.5:
        assert last.effective_activation_ratio == pytest.approx(0.5, abs=1e-6)
    if case["ratio"] == 1.0:
        assert last.effective_activation_ratio == pytest.approx(1.0, abs=1e-6)
    check_routing(last, case["ratio"])


def check_routing(last, ratio):
    """Per-layer head loads consistent with usage and the ratio's K."""
    routing = last.routing
    # Every prompt token and every generated token but the last one went
    # through the model once.
    tokens = last.usage.prompt_tokens + last.usage.completion_tokens - 1
    assert routing.tokens == tokens, routing
    assert [l.layer for l in routing.layers] == list(range(lib.LM_LAYERS))
    top_k = lib.expected_top_k(ratio)
    used = 0
    for layer, k in zip(routing.layers, top_k):
        heads = list(layer.head_tokens)
        assert len(heads) == lib.LM_HEADS, layer
        # Shared heads serve every token; each token uses S + K heads.
        assert heads[:lib.LM_SHARED] == [tokens] * lib.LM_SHARED, layer
        assert all(0 <= h <= tokens for h in heads), layer
        assert sum(heads) == tokens * (lib.LM_SHARED + k), (layer, k)
        used += sum(heads)
    assert last.effective_activation_ratio == pytest.approx(
        used / (tokens * lib.LM_HEADS * lib.LM_LAYERS), abs=1e-5)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_greedy_stream_equals_reference(api, stub, case):
    messages = lib.run_generate(stub, golden_request(api, case))
    check_golden_stream(api, case, messages)


def test_without_include_routing_no_routing(api, stub):
    messages = lib.run_generate(stub,
                                golden_request(api, CASES[0],
                                               include_routing=False))
    assert lib.token_ids_of(messages) == CASES[0]["greedy"]
    assert not messages[-1].HasField("routing")


def _run_together(api, stub, cases):
    """Starts one stream per case at the same moment; returns their messages."""
    return lib.generate_together(
        stub, [golden_request(api, case) for case in cases])


def test_two_concurrent_streams_with_different_ratios(api, stub):
    # Same prompt, ratios 0.5 and 1.0, in flight together: each gets what it
    # gets alone (K is per row of a shared batch).
    by_ratio = {(c["prompt"], c["ratio"]): c for c in CASES}
    pairs = [[by_ratio[(p, 0.5)], by_ratio[(p, 1.0)]]
             for p in range(len(_GOLDEN["prompts"]))]
    # Otherwise mixing up the rows' ratios would go unnoticed.
    assert any(a["greedy"] != b["greedy"] for a, b in pairs)
    for pair in pairs:
        for case, messages in zip(pair, _run_together(api, stub, pair)):
            check_golden_stream(api, case, messages)


def test_all_golden_cases_concurrently(api, stub):
    # 12 streams on a server with max_running 4: some wait, all still match.
    results = _run_together(api, stub, CASES)
    for case, messages in zip(CASES, results):
        check_golden_stream(api, case, messages)


def test_text_prompt_streams_chunks_that_concatenate(api, stub, decoder):
    request = lib.generate_request(api.pb,
                                   prompt="Once upon a time",
                                   max_new_tokens=16,
                                   include_routing=True)
    messages = lib.run_generate(stub, request)
    # The first token arrives in its own message, before the final one
    # (what follows may be coalesced while that one is written).
    assert len(messages) >= 2, messages
    assert len(messages[0].token_ids) == 1 and not messages[0].finish_reason
    last = messages[-1]
    assert last.finish_reason == api.pb.LENGTH
    ids = lib.token_ids_of(messages)
    assert len(ids) == last.usage.completion_tokens == 16
    text = "".join(m.text for m in messages)
    assert text == decoder.decode(ids)
    assert text.strip(), "generated text is empty"
    # prompt_tokens counts the BOS the tokenizer adds.
    assert last.usage.prompt_tokens > 1
    check_routing(last, 0.0)


def test_stop_string_ends_before_the_match(api, stub):
    base = lib.generate_request(api.pb, prompt="Once upon a time",
                                max_new_tokens=16)
    full = "".join(m.text for m in lib.run_generate(stub, base))
    # A stop string from the middle of the greedy text.
    start = len(full) // 2
    stop = full[start:start + 2]
    assert len(stop) == 2 and "\ufffd" not in stop, full
    expected = full[:full.index(stop)]
    request = lib.generate_request(api.pb, prompt="Once upon a time",
                                   max_new_tokens=16, stop=[stop, "zzzz"])
    messages = lib.run_generate(stub, request)
    last = messages[-1]
    assert last.finish_reason == api.pb.STOP, last
    assert "".join(m.text for m in messages) == expected
    assert last.usage.completion_tokens == len(lib.token_ids_of(messages))
    assert last.usage.completion_tokens < 16


def test_eos_finishes_the_stream(api, stub):
    # With the fixture model, some short prompts reach EOS well within 200
    # tokens at ratio 1.0 (found by trying; the model is deterministic).
    finishes = {}
    for prompt in ("the", "a", "x"):
        request = lib.generate_request(api.pb, prompt=prompt,
                                       max_new_tokens=200, ratio=1.0)
        messages = lib.run_generate(stub, request)
        last = messages[-1]
        finishes[prompt] = api.pb.FinishReason.Name(last.finish_reason)
        if last.finish_reason == api.pb.EOS:
            ids = lib.token_ids_of(messages)
            assert ids[-1] == lib.LM_EOS
            assert lib.LM_EOS not in ids[:-1]
            assert last.usage.completion_tokens == len(ids) < 200
    assert "EOS" in finishes.values(), finishes


def test_seeded_sampling_is_reproducible(api, stub):
    def sample(seed):
        request = lib.generate_request(api.pb, prompt="Once upon a time",
                                       max_new_tokens=24, temperature=1.0,
                                       top_k=50, top_p=0.95, seed=seed)
        messages = lib.run_generate(stub, request)
        assert messages[-1].finish_reason in (api.pb.LENGTH, api.pb.EOS)
        return lib.token_ids_of(messages)

    first = sample(7)
    assert sample(7) == first
    assert all(0 <= t < lib.LM_VOCAB for t in first)
    others = [sample(seed) for seed in (8, 9, 10)]
    assert any(o != first for o in others), "the seed has no effect"


def test_rows_reduced_where_the_logits_lie_stream_the_same(api, stub, main_server,
                                                           server_factory, monkeypatch):
    # MOH_REDUCE_LOGITS=1: the CPU server takes rows' tokens from what their logits
    # reduce to where they lie, as a GPU step does (DecoderBatch::top_logits and
    # row_reductions): greedy, top-k, top-p alone, temperature alone (drawn on the
    # device), log-probabilities; in one batch with a row copied whole (a penalty).
    # Every stream equals the main server's, which samples every row from the whole
    # of it.
    monkeypatch.setenv("MOH_REDUCE_LOGITS", "1")
    reduced = server_factory("reduced", [("demo-lm", lib.LM_DIR,
                                          "generation { max_running: 8 }")])
    monkeypatch.delenv("MOH_REDUCE_LOGITS")
    samplings = [dict(temperature=0.0, logprobs=3),
                 dict(temperature=2.0, top_k=5, seed=3),
                 dict(temperature=2.0, top_k=40, top_p=0.95, min_p=0.01, seed=4),
                 dict(temperature=2.0, top_p=0.95, seed=5, logprobs=1),
                 dict(temperature=2.0, top_k=8, presence_penalty=0.5, seed=6),
                 dict(temperature=1.5, seed=7),
                 dict(temperature=1.0, min_p=0.02, seed=8, logprobs=2),
                 # Flat: its nucleus passes the best 256, so the row goes whole.
                 dict(temperature=50.0, top_p=0.99, seed=9)]
    requests = [lib.generate_request(api.pb, prompt="Once upon a time", max_new_tokens=24,
                                     ignore_eos=True, **sampling)
                for sampling in samplings]
    want = lib.generate_together(stub, requests)
    reduced_stub = api.grpc.InferenceStub(reduced.channel())
    got = lib.generate_together(reduced_stub, requests)
    assert [lib.token_ids_of(m) for m in got] == [lib.token_ids_of(m) for m in want]
    assert len(set(tuple(lib.token_ids_of(m)) for m in want)) == len(want), \
        "the samplings made the same tokens"
    for sampling, got_messages, want_messages in zip(samplings, got, want):
        got_logprobs = [e for m in got_messages for e in m.logprobs]
        want_logprobs = [e for m in want_messages for e in m.logprobs]
        assert len(got_logprobs) == len(want_logprobs) == (24 if "logprobs" in sampling else 0)
        for g, w in zip(got_logprobs, want_logprobs):
            assert (g.token_id, g.rank) == (w.token_id, w.rank)
            # The two servers batch differently, and LibTorch 2.x's CPU products
            # round differently by batch size: the logits differ in their last bits.
            assert g.logprob == pytest.approx(w.logprob, rel=1e-3, abs=1e-3)
            assert [t.token_id for t in g.top_logprobs] == [t.token_id for t in w.top_logprobs]
    # moh_sampled_tokens_total: what each server drew its tokens from.
    def sampled(server):
        return {ls["logits"]: v for ls, v in lib.metric_series(
            server.samples(), "moh_sampled_tokens_total", model="demo-lm")}
    counts = sampled(reduced)
    assert counts["whole"] >= 24  # the penalty row (and any warm-up)
    assert counts["reduced_then_whole"] >= 24  # the flat row (and any edge)
    assert counts["reduced"] >= 24 * (len(samplings) - 3)
    assert sampled(main_server)["reduced"] == 0  # a CPU server samples whole rows


def test_default_model_is_used_when_model_is_empty(api, stub):
    # Two models are served; Generate with model "" goes to the only LM.
    case = CASES[0]
    request = golden_request(api, case)
    request.model = ""
    check_golden_stream(api, case, lib.run_generate(stub, request))


def test_adaptive_min_ratio_without_load_keeps_the_ratio(api, stub):
    # adaptive is off on this server: min_ratio is accepted and ignored.
    case = next(c for c in CASES if c["ratio"] == 1.0)
    request = golden_request(api, case)
    request.activation.min_ratio = 0.5
    messages = lib.run_generate(stub, request)
    check_golden_stream(api, case, messages)
    assert messages[-1].activation_ratio == pytest.approx(1.0)


def test_unset_max_new_tokens_fits_what_the_context_leaves(api, stub):
    # demo-lm: max_seq_len 256, default max_new_tokens 64. A 250-token prompt
    # leaves room for 6: an unset max_new_tokens is clamped, not refused.
    request = lib.generate_request(api.pb, model="demo-lm",
                                   token_ids=[5] * 250)
    request.sampling.ClearField("max_new_tokens")
    messages = lib.run_generate(stub, request)
    assert 1 <= messages[-1].usage.completion_tokens <= 6
    # Set explicitly, the same length is still refused, naming the field.
    request.sampling.max_new_tokens = 64
    error = lib.rpc_error(lib.run_generate, stub, request)
    assert "sampling.max_new_tokens" in error.details()


def test_a_slow_reader_gets_the_tokens_coalesced(api, start_server,
                                                 long_lm_dir):
    # A client that reads late, through a small HTTP/2 window: while gRPC
    # waits to write one message, the tokens produced meanwhile go out
    # together in the next one. The stream carries the same ids and text as
    # one read at once, the summary last.
    server = start_server("coalescing", [
        ("long", long_lm_dir, "generation { max_seq_len: 512 }")
    ], metrics=False)
    request = lib.generate_request(api.pb, model="long",
                                   prompt="Once upon a time",
                                   max_new_tokens=300)
    eager_stub = api.grpc.InferenceStub(server.channel())
    eager = lib.run_generate(eager_stub, request)
    channel = grpc.insecure_channel(
        server.target, options=[("grpc.http2.lookahead_bytes", 1024),
                                ("grpc.http2.bdp_probe", 0)])
    try:
        call = api.grpc.InferenceStub(channel).Generate(
            request, timeout=lib.RPC_TIMEOUT)
        time.sleep(1.5)  # the server generates on; the window fills
        late = lib.drain_stream(call, lib.RPC_TIMEOUT)
    finally:
        channel.close()
    # Compared with the tokens, not with the eager reader's messages: on a
    # loaded machine the eager reader's writes are coalesced too.
    tokens = len(lib.token_ids_of(eager))
    assert tokens > 100 and len(late) < tokens // 2, (len(late), tokens)
    assert lib.token_ids_of(late) == lib.token_ids_of(eager)
    assert "".join(m.text for m in late) == "".join(m.text for m in eager)
    for m in late[:-1]:
        assert m.finish_reason == api.pb.FINISH_REASON_UNSPECIFIED
    assert late[-1].finish_reason == api.pb.LENGTH
    assert late[-1].usage.completion_tokens == 300


def log_softmax(row):
    top = max(row)
    log_z = top + math.log(sum(math.exp(x - top) for x in row))
    return [x - log_z for x in row]


def best(logprobs, n):
    """The n best token ids, ties to the lower id."""
    return sorted(range(len(logprobs)), key=lambda i: (-logprobs[i], i))[:n]


@pytest.mark.parametrize("case", [c for c in CASES if c["prompt"] == 0],
                         ids=lambda c: "ratio%g" % c["ratio"])
def test_logprobs_equal_the_references(api, stub, case):
    # The reference's logits at every prompt position: prompt token p + 1's
    # log-probability, and the first generated token's.
    prompt = _GOLDEN["prompts"][case["prompt"]]
    reference = [log_softmax(row) for row in case["logits"]]
    request = golden_request(api, case, include_routing=False)
    request.sampling.logprobs = 3
    request.sampling.prompt_logprobs = 2
    messages = lib.run_generate(stub, request)
    assert lib.token_ids_of(messages) == case["greedy"]
    entries = [e for m in messages for e in m.logprobs]
    assert [e.token_id for e in entries] == case["greedy"]
    first = entries[0]
    assert first.logprob == pytest.approx(
        reference[-1][case["greedy"][0]], abs=2e-4)
    assert first.rank == 1  # greedy
    assert [t.token_id for t in first.top_logprobs] == best(reference[-1], 3)
    for t in first.top_logprobs:
        assert t.logprob == pytest.approx(reference[-1][t.token_id], abs=2e-4)
    assert all(e.rank == 1 and len(e.top_logprobs) == 3 for e in entries)
    # Prompt log-probabilities come once, on the first message.
    assert all(not m.prompt_logprobs for m in messages[1:])
    prompt_entries = messages[0].prompt_logprobs
    assert [e.token_id for e in prompt_entries] == prompt[1:]
    for p, e in enumerate(prompt_entries):
        row = reference[p]
        assert e.logprob == pytest.approx(row[prompt[p + 1]], abs=2e-4), p
        assert e.rank == 1 + sum(x > row[prompt[p + 1]] for x in row), p
        assert [t.token_id for t in e.top_logprobs] == best(row, 2), p


def test_logprobs_out_of_range_name_the_field(api, stub):
    for field, value in (("logprobs", 21), ("prompt_logprobs", -1)):
        request = golden_request(api, CASES[0], include_routing=False)
        setattr(request.sampling, field, value)
        error = lib.rpc_error(stub.Generate, request, timeout=lib.RPC_TIMEOUT)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert ("sampling.%s must be in [0, 20] (absent = none), got %d"
                % (field, value)) in error.details()


def test_presence_frequency_and_min_p(api, stub):
    # A frequency penalty at its maximum breaks greedy repetition: the output
    # differs from plain greedy decoding and repeats no more often.
    case = min(CASES, key=lambda c: len(set(c["greedy"])))
    plain = case["greedy"]
    assert len(set(plain)) < len(plain)
    request = golden_request(api, case, include_routing=False)
    request.sampling.frequency_penalty = 2.0
    request.sampling.presence_penalty = 2.0
    penalised = lib.token_ids_of(lib.run_generate(stub, request))
    assert penalised != plain
    assert len(set(penalised)) > len(set(plain))
    # min_p 1 keeps only the most likely token: sampling is greedy.
    request = golden_request(api, case, include_routing=False)
    request.sampling.temperature = 1.5
    request.sampling.min_p = 1.0
    assert lib.token_ids_of(lib.run_generate(stub, request)) == case["greedy"]
    request.sampling.min_p = 1.5
    error = lib.rpc_error(stub.Generate, request, timeout=lib.RPC_TIMEOUT)
    assert "sampling.min_p must be in [0, 1] (0 = off), got 1.5" in error.details()


def test_prompt_logprobs_beside_other_requests(api, stub):
    # A request asking for prompt log-probabilities runs its prompt in a
    # forward of its own; beside plain requests in flight at the same time,
    # every output is what it is alone.
    cases = [c for c in CASES if c["prompt"] in (0, 1)][:4]
    requests = [golden_request(api, c, include_routing=False) for c in cases]
    requests[0].sampling.prompt_logprobs = 1
    requests[0].sampling.logprobs = 1
    alone = lib.run_generate(stub, requests[0])
    together = lib.generate_together(stub, requests)
    for case, messages in zip(cases, together):
        assert lib.token_ids_of(messages) == case["greedy"]
    got = [e for m in together[0] for e in m.logprobs]
    want = [e for m in alone for e in m.logprobs]
    assert [e.token_id for e in got] == [e.token_id for e in want]
    # Alone its decode steps are batch-1 products (RowLinear), beside the
    # others 2-4-row ones (SkinnyLinear), whose sums round in another order:
    # measured up to 1.2e-5 apart, as the batches happen to form.
    assert [e.logprob for e in got] == pytest.approx(
        [e.logprob for e in want], abs=5e-5)
    assert ([(e.token_id, e.rank) for e in together[0][0].prompt_logprobs] ==
            [(e.token_id, e.rank) for e in alone[0].prompt_logprobs])


def test_cuda_switches_are_taken_and_logged(api, server_factory):
    """generation.cuda_paths, cuda_programmatic_launch and
    gpu_memory_fraction (CUDA only: the operator's fallbacks should a kernel
    path misbehave on a device, and a GPU shared with other processes; on a
    CUDA device test_gpu.py serves them) are accepted, logged, and change
    nothing of a CPU model's answers."""
    paths = ("paged_decode", "fused_ops", "varlen_prefill", "skinny_linear")
    server = server_factory("cuda_switches", [
        ("lm", lib.LM_DIR,
         'device: "cpu" generation { max_running: 4 cuda_paths { %s } }' %
         " ".join("%s: false" % p for p in paths)),
    ], extra="cuda_programmatic_launch: true gpu_memory_fraction: 0.5",
       metrics=False)
    stub = api.grpc.InferenceStub(server.channel())
    for case in CASES[:2]:
        request = golden_request(api, case)
        request.model = "lm"
        check_golden_stream(api, case, lib.run_generate(stub, request))
    log = server.log()
    assert "model lm: CUDA paths off: %s (generation.cuda_paths)" % (
        ", ".join(paths)) in log, log
    assert "programmatic dependent launch (cuda_programmatic_launch)" in log
    assert "at most 0.5 of its memory (gpu_memory_fraction)" in log


def test_out_of_range_gpu_memory_fraction_is_refused():
    run = subprocess.run([lib.SERVER, "--gpu_memory_fraction=1.5",
                          "--model_dir=" + lib.LM_DIR], capture_output=True,
                         text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert run.returncode == 2, run
    assert ("gpu_memory_fraction must be in (0, 1], got 1.5"
            in run.stdout + run.stderr), run
