"""Soak: one moh-server serving the three demo models on every door under mixed load.

Client threads loop over a seeded mix of requests for --duration seconds,
through gRPC and the HTTP API (OpenAI and Anthropic), and every answer that
the server promises exactly is checked against what it must be:
  gRPC   greedy streams (by ratio, and through the alias demo-lm@0.5) equal the
         Python model's tokens (models/demo-lm/golden.json); long prompts that
         share a prefix equal what they gave alone, cached or not; n = 2 sampled
         streams with log-probabilities and a stop string end both samples;
         adaptive activation stays within [min_ratio, ratio]; JSON mode yields
         JSON when it ends; streams the client cancels after two messages;
         streams whose deadline passes mid-way; label scores, digit
         probabilities and DiT images (with progress, or cancelled) equal the
         Python models' within the demo tests' tolerances; random PNGs;
         bad input (a ratio out of range, a GIF).
  HTTP   greedy completions (echo, log-probabilities) and streamed chat equal
         what the same request got alone before the load; clients that leave a
         stream; a JSON-schema chat yields the schema's object when it ends;
         Anthropic message streams come in their event order; bad bodies get
         the error naming the field; /tokenize gives the goldens' prompt ids
         and /detokenize the prompt back.
  Meta   ListModels and GET /v1/models list every model and alias, READY;
         /health answers 200; /metrics scrapes under the load.
Checks, printed as a table:
  - every request got one final status its case allows, and every checked
    answer was right;
  - the server counted every request it received (moh_requests_total grew by
    the number sent, less at most the gRPC calls whose deadline passed before
    they reached it);
  - the long prompts, which share their first KV blocks and repeat, hit the
    prefix cache (and, above, equal what they gave alone);
  - steps that ran out of memory ran again in smaller steps: the server runs
    with injected faults (--memory_tokens: demo-lm's steps of more than 32
    tokens run out of memory, demo-vit's batches of more than 2 images), so
    every answer above came through them;
  - resident memory after the warm-up (the first fifth) grew less than 5%;
  - open file descriptors did not grow;
  - on SIGTERM the server drains and exits 0 (with an ASan build under
    detect_leaks=1, LeakSanitizer's verdict at exit).
Exit status 1 when a check fails.

  python3 bench/soak.py [--duration 600] [--clients 8] [--seed 1]
                        [--device cuda] [--memory_tokens 32|-1]
(after `scripts/build.sh`; the integration tests' helpers start the server,
$MOH_SERVER if set). With --device cuda the models run there in bfloat16 and
the answers are checked for their form (counts, order, ranges, JSON), not
against the float32 goldens; the device check runs it so.
"""
import argparse
import http.client
import io
import json
import os
import random
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE_DIR = os.path.dirname(HERE)
MODELS = os.path.join(SOURCE_DIR, "models")
sys.path.insert(0, os.path.join(SOURCE_DIR, "tests", "integration"))
sys.path.insert(0, os.path.join(SOURCE_DIR, "training"))

import grpc  # noqa: E402

from cuda_paths import path_config, paths_off  # noqa: E402

import demo_eval  # noqa: E402
import moh_testdata  # noqa: E402
import moh_testlib as lib  # noqa: E402

GIF_1X1 = (b"GIF89a\x01\x00\x01\x00\x80\x00\x00\xff\xff\xff\x00\x00\x00"
           b"!\xf9\x04\x01\x00\x00\x00\x00,\x00\x00\x00\x00\x01\x00\x01"
           b"\x00\x00\x02\x02D\x01\x00;")
# The demo tests' tolerances (tests/integration/test_demo_models.py).
PROB_TOLERANCE = 1e-4
LOG_LIKELIHOOD_TOLERANCE = 2e-3
PIXEL_TOLERANCE = 1
ALIAS = "demo-lm@0.5"
JSON_SCHEMA = {"type": "object", "properties": {"digit": {"type": "integer"}},
               "required": ["digit"]}

OK = "OK"
# Each case: the final statuses it may end with (gRPC codes; HTTP_<status>).
ALLOWED = {
    "greedy": {OK},
    "sampled": {OK},
    "adaptive": {OK},
    "json_mode": {OK},
    "cancel": {"CANCELLED", OK},
    "deadline": {"DEADLINE_EXCEEDED", OK},
    "bad_ratio": {"INVALID_ARGUMENT"},
    "labels": {OK},
    "digits": {OK},
    "image": {OK},
    "bad_image": {"INVALID_ARGUMENT"},
    "dit": {OK},
    "dit_cancel": {"CANCELLED", OK},
    "http_completion": {"HTTP_200"},
    "http_chat_stream": {"HTTP_200"},
    "http_leave": {"HTTP_200"},
    "http_json_schema": {"HTTP_200"},
    "anthropic_stream": {"HTTP_200"},
    "http_bad": {"HTTP_400"},
    "tokenize": {"HTTP_200"},
    "metadata": {OK},
    "long_prefix": {OK},
}
# How many requests of moh_requests_total one run of a case makes, where not
# one (ListModels, /v1/models, /health and /metrics are not counted).
COUNTED = {"tokenize": 2, "metadata": 0}
# gRPC calls that may end on the client before they reach the server.
MAY_BE_UNSEEN = {("deadline", "DEADLINE_EXCEEDED")}
# Long prompts that share their first KV blocks (the prefix cache's, which
# other traffic evicts now and then) and each repeat whole.
LONG_PREFIX = ("The owl said that the night was long, and the stars were bright "
               "over the quiet hills. ") * 5
LONG_PROMPTS = [LONG_PREFIX + ending for ending in (
    "Then the fox came out of the wood.", "In the morning the king rode away.",
    "She opened the door and looked outside.", "Once upon a time there was")]
# What ListModels and GET /v1/models list.
MODEL_NAMES = ["demo-dit", "demo-lm", "demo-lm@0.5", "demo-vit"]


class Wrong(Exception):
    """An answer that is not what the server promises."""


def load_api(workdir):
    import importlib
    import subprocess
    stub_dir = os.path.join(workdir, "stubs")
    subprocess.run(["bash", os.path.join(SOURCE_DIR, "client", "python",
                                         "gen_stubs.sh"), stub_dir],
                   check=True, timeout=120)
    sys.path.insert(0, stub_dir)
    pb = importlib.import_module("moh.v1.inference_pb2")
    stubs = importlib.import_module("moh.v1.inference_pb2_grpc")
    return pb, stubs


def png_pixels(png):
    from PIL import Image
    with Image.open(io.BytesIO(png)) as image:
        return list(image.getdata())


def expect(condition, what):
    if not condition:
        raise Wrong(what)


def http_call(server, method, path, body=None):
    """(status, parsed JSON or text) of one request to `server`'s HTTP API
    (moh_testlib's)."""
    status, _, answer = lib.http_request(server, method, path, body)
    return status, answer


def http_stream(server, path, body):
    """(status, the non-empty lines of a 200's event stream, or the error)."""
    status, answer = http_call(server, "POST", path, body)
    return status, ([line for line in answer.splitlines() if line]
                    if status == 200 else answer)


def cancel_after(call, messages):
    """Reads `messages` messages of a stream, then cancels it."""
    for _ in range(messages):
        next(call)
    call.cancel()
    for _ in call:
        pass
    return OK


def sse_data(lines):
    """The JSON of each `data:` line but [DONE], and whether [DONE] came."""
    events = [line[len("data: "):] for line in lines
              if line.startswith("data: ")]
    done = bool(events) and events[-1] == "[DONE]"
    return [json.loads(e) for e in events if e != "[DONE]"], done


class Soak:
    """The requests of each case (case_NAME) and what their answers must
    be."""

    def __init__(self, server, pb, stubs, exact):
        # exact: answers against the goldens; else (bfloat16 on a GPU, off
        # the float32 goldens by rounding) their form only.
        self.exact = exact
        self.server = server
        self.pb = pb
        self.stubs = stubs
        self.lm = demo_eval.read_json(MODELS, "demo-lm", "golden.json")
        self.vit = demo_eval.read_json(MODELS, "demo-vit", "golden.json")
        self.dit = demo_eval.read_json(MODELS, "demo-dit", "golden.json")
        self.digits = demo_eval.heldout_digits(MODELS)[0]
        self.references = {}

    # Answers the long prompts and the HTTP cases must repeat: each request
    # alone, before the load.

    def completion_body(self, case, echo):
        return {"model": "demo-lm", "prompt": case["prompt"],
                "max_tokens": self.lm["new_tokens"], "temperature": 0,
                "logprobs": 2, "echo": echo}

    def chat_body(self, case, stream):
        return {"model": "demo-lm", "max_tokens": 16, "temperature": 0,
                "stream": stream,
                "messages": [{"role": "user", "content": case["prompt"]}]}

    def long_request(self, prompt):
        return lib.generate_request(self.pb, prompt=prompt, temperature=0.0,
                                    max_new_tokens=8)

    def record_references(self):
        stub = self.stubs.InferenceStub(self.server.channel())
        for prompt in LONG_PROMPTS:
            messages = list(stub.Generate(self.long_request(prompt), timeout=60))
            prompt_tokens = messages[-1].usage.prompt_tokens
            assert 100 <= prompt_tokens <= 200, prompt_tokens
            self.references[("long", prompt)] = lib.token_ids_of(messages)
        for i, case in enumerate(self.lm["cases"]):
            for echo in (False, True):
                status, body = http_call(self.server, "POST",
                                         "/v1/completions",
                                         self.completion_body(case, echo))
                assert status == 200, body
                self.references[("completion", i, echo)] = completion_answer(
                    body)
            status, body = http_call(self.server, "POST",
                                     "/v1/chat/completions",
                                     self.chat_body(case, False))
            assert status == 200, body
            self.references[("chat", i)] = body["choices"][0]["message"][
                "content"]

    # One request of `name`; returns its final status.

    def run(self, name, stub, rng):
        try:
            return getattr(self, "case_" + name)(stub, rng)
        except grpc.RpcError as e:
            return e.code().name
        except StopIteration:
            return OK  # a stream shorter than what the case reads

    def case_greedy(self, stub, rng):
        case = rng.choice(self.lm["cases"])
        ratio = rng.choice(sorted(case["greedy"]))
        alias = ratio == "0.5" and rng.random() < 0.5
        request = lib.generate_request(
            self.pb, prompt=case["prompt"], model=ALIAS if alias else "demo-lm",
            ratio=0.0 if alias else float(ratio), temperature=0.0,
            max_new_tokens=self.lm["new_tokens"],
            include_routing=rng.random() < 0.5)
        if rng.random() < 0.3:
            # Its prompt runs in a forward of its own; the tokens are the same.
            request.sampling.prompt_logprobs = 1
            request.sampling.logprobs = 1
        messages = list(stub.Generate(request, timeout=60))
        want = case["greedy"][ratio]
        got = lib.token_ids_of(messages)
        expect(got[:len(want)] == want if self.exact else
               0 < len(got) <= self.lm["new_tokens"],
               "greedy %r at %s: %s, want %s" % (case["prompt"], ratio, got,
                                                 want))
        expect(messages[-1].usage.prompt_tokens == len(case["prompt_ids"]),
               "prompt_tokens %d" % messages[-1].usage.prompt_tokens)
        return OK

    # Draws of every kind: from the reduced logits, and from whole rows
    # (penalties, min_tokens, min_p).
    SAMPLING = [{}, {"top_k": 5}, {"min_p": 0.1}, {"repetition_penalty": 1.3},
                {"presence_penalty": 0.5, "frequency_penalty": 0.5},
                {"min_tokens": 4, "stop_token_ids": [44]}, {"ignore_eos": True}]

    def case_sampled(self, stub, rng):
        extra = dict(rng.choice(self.SAMPLING))
        stop_ids = extra.pop("stop_token_ids", [])
        request = lib.generate_request(
            self.pb, prompt=rng.choice(self.lm["cases"])["prompt"],
            max_new_tokens=24, temperature=0.8, top_p=0.9,
            seed=rng.randrange(1000), logprobs=2, stop=[" the"],
            ratio=rng.choice([0.0, 0.5, 1.0]), **extra)
        request.sampling.stop_token_ids.extend(stop_ids)
        request.n = 2
        ends = {}
        for m in stub.Generate(request, timeout=60):
            expect(len(m.logprobs) == len(m.token_ids),
                   "%d log-probabilities for %d tokens" %
                   (len(m.logprobs), len(m.token_ids)))
            if m.finish_reason:
                ends[m.index] = ends.get(m.index, 0) + 1
        expect(ends == {0: 1, 1: 1}, "samples' last messages %s" % ends)
        return OK

    def case_adaptive(self, stub, rng):
        request = lib.generate_request(
            self.pb, prompt=rng.choice(self.lm["cases"])["prompt"],
            max_new_tokens=16, temperature=0.0, ratio=1.0, min_ratio=0.5)
        request.priority = rng.randrange(-5, 6)
        last = list(stub.Generate(request, timeout=60))[-1]
        expect(0.5 - 1e-6 <= last.activation_ratio <= 1.0 + 1e-6,
               "activation_ratio %g outside [0.5, 1]" % last.activation_ratio)
        return OK

    def case_json_mode(self, stub, rng):
        request = lib.generate_request(
            self.pb, prompt="Once upon a time", max_new_tokens=48,
            temperature=rng.choice([0.0, 0.8]), seed=rng.randrange(1000))
        request.response_format.json_object.SetInParent()
        messages = list(stub.Generate(request, timeout=60))
        if messages[-1].finish_reason == self.pb.EOS:
            text = "".join(m.text for m in messages)
            try:
                expect(isinstance(json.loads(text), dict),
                       "JSON mode: not an object: %r" % text)
            except ValueError:
                raise Wrong("JSON mode: not JSON: %r" % text)
        return OK

    def case_cancel(self, stub, rng):
        call = stub.Generate(lib.generate_request(
            self.pb, prompt="Once upon a time", max_new_tokens=24,
            temperature=0.8, seed=rng.randrange(1000)), timeout=60)
        return cancel_after(call, 2)

    def case_deadline(self, stub, rng):
        for _ in stub.Generate(lib.generate_request(
                self.pb, prompt="Once upon a time", max_new_tokens=200,
                ratio=rng.choice([0.0, 0.5])), timeout=0.05):
            pass
        return OK

    def case_bad_ratio(self, stub, rng):
        list(stub.Generate(lib.generate_request(
            self.pb, prompt="Once upon a time", ratio=7.0), timeout=60))
        return OK

    def case_long_prefix(self, stub, rng):
        prompt = rng.choice(LONG_PROMPTS)
        messages = list(stub.Generate(self.long_request(prompt), timeout=60))
        got = lib.token_ids_of(messages)
        want = self.references.get(("long", prompt), got)
        expect(got == want and 0 < len(got) <= 8,
               "long prompt %d: %s, alone %s" % (LONG_PROMPTS.index(prompt),
                                                got, want))
        return OK

    def case_labels(self, stub, rng):
        case = rng.choice(self.lm["cases"])
        ratio = rng.choice(sorted(case["label_log_likelihoods"]))
        request = self.pb.ClassifyRequest(model="demo-lm", text=case["prompt"])
        request.labels.extend(case["labels"])
        request.activation.ratio = float(ratio)
        response = stub.Classify(request, timeout=60)
        got = {c.index: c.log_likelihood for c in response.classes}
        expect(sorted(got) == list(range(len(case["labels"]))) and
               all(v <= 0 for v in got.values()), "label scores %s" % got)
        for i, want in enumerate(case["label_log_likelihoods"][ratio]):
            expect(not self.exact or
                   abs(got[i] - want) <= LOG_LIKELIHOOD_TOLERANCE,
                   "label %r at %s: %g, want %g" % (case["labels"][i], ratio,
                                                    got[i], want))
        return OK

    def case_digits(self, stub, rng):
        case = rng.choice(self.vit["cases"])
        ratio = rng.choice(sorted(case["probabilities"]))
        response = stub.Classify(demo_eval.pixels_request(
            self.pb, self.digits[case["heldout_index"]], float(ratio),
            top_n=10), timeout=60)
        got = {c.index: c.score for c in response.classes}
        expect(sorted(got) == list(range(10)) and
               abs(sum(got.values()) - 1) < 1e-3, "digit scores %s" % got)
        for k, want in enumerate(case["probabilities"][ratio]):
            expect(not self.exact or abs(got[k] - want) <= PROB_TOLERANCE,
                   "digit %d at %s: p(%d) %g, want %g" % (
                       case["heldout_index"], ratio, k, got[k], want))
        return OK

    def case_image(self, stub, rng):
        image = moh_testdata.encode_png(
            [[[rng.random() for _ in range(16)] for _ in range(16)]
             for _ in range(3)])
        stub.Classify(self.pb.ClassifyRequest(model="demo-vit", image=image),
                      timeout=60)
        return OK

    def case_bad_image(self, stub, rng):
        stub.Classify(self.pb.ClassifyRequest(model="demo-vit", image=GIF_1X1),
                      timeout=60)
        return OK

    def image_request(self, sample, progress):
        request = demo_eval.image_request(
            self.pb, sample["class"], sample["seed"], sample["ratio"],
            sample["steps"], sample["guidance"])
        request.progress = progress
        return request

    def case_dit(self, stub, rng):
        sample = rng.choice(self.dit["samples"])
        messages = list(stub.GenerateImage(
            self.image_request(sample, rng.random() < 0.5), timeout=60))
        last = messages[-1]
        expect(last.png.startswith(b"\x89PNG") and
               (last.width, last.height) == (8, 8),
               "image %dx%d, PNG %r" % (last.width, last.height, last.png[:8]))
        if not self.exact:
            return OK
        got = png_pixels(last.png)
        want = [v for row in sample["image_u8"][0] for v in row]
        worst = max(abs(g - w) for g, w in zip(got, want))
        expect(len(got) == len(want) and worst <= PIXEL_TOLERANCE,
               "image of class %d seed %d at %g: off by %d" % (
                   sample["class"], sample["seed"], sample["ratio"], worst))
        return OK

    def case_dit_cancel(self, stub, rng):
        call = stub.GenerateImage(
            self.image_request(rng.choice(self.dit["samples"]), True),
            timeout=60)
        return cancel_after(call, 1)

    def case_http_completion(self, stub, rng):
        i = rng.randrange(len(self.lm["cases"]))
        echo = rng.random() < 0.5
        status, body = http_call(
            self.server, "POST", "/v1/completions",
            self.completion_body(self.lm["cases"][i], echo))
        if status == 200 and self.exact:
            got = completion_answer(body)
            want = self.references[("completion", i, echo)]
            expect(got == want, "completion %d (echo %s): %r, want %r" %
                   (i, echo, got, want))
        return "HTTP_%d" % status

    def case_http_chat_stream(self, stub, rng):
        i = rng.randrange(len(self.lm["cases"]))
        status, lines = http_stream(self.server, "/v1/chat/completions",
                                    self.chat_body(self.lm["cases"][i], True))
        if status == 200:
            chunks, done = sse_data(lines)
            expect(done, "chat stream without [DONE]")
            text = "".join(c["choices"][0]["delta"].get("content") or ""
                           for c in chunks if c.get("choices"))
            want = self.references.get(("chat", i), text)
            expect(text == want, "chat %d: %r, want %r" % (i, text, want))
        return "HTTP_%d" % status

    def case_http_leave(self, stub, rng):
        conn = http.client.HTTPConnection("127.0.0.1", self.server.http_port,
                                          timeout=lib.RPC_TIMEOUT)
        try:
            conn.request("POST", "/v1/completions", body=json.dumps({
                "model": "demo-lm", "prompt": "Once upon a time",
                "max_tokens": 200, "stream": True,
                "seed": rng.randrange(1000)}),
                headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            if response.status == 200:
                response.readline()
                conn.sock.shutdown(socket.SHUT_RDWR)
            return "HTTP_%d" % response.status
        finally:
            conn.close()

    def case_http_json_schema(self, stub, rng):
        status, body = http_call(
            self.server, "POST", "/v1/chat/completions", {
                "model": "demo-lm", "max_tokens": 48,
                "temperature": rng.choice([0, 0.8]),
                "seed": rng.randrange(1000),
                "messages": [{"role": "user", "content": "A digit, please"}],
                "response_format": {"type": "json_schema", "json_schema": {
                    "name": "digit", "schema": JSON_SCHEMA}}})
        if status == 200 and body["choices"][0]["finish_reason"] == "stop":
            text = body["choices"][0]["message"]["content"]
            try:
                value = json.loads(text)
            except ValueError:
                raise Wrong("json_schema: not JSON: %r" % text)
            expect(isinstance(value, dict) and set(value) == {"digit"} and
                   isinstance(value["digit"], int),
                   "json_schema: %r is not the schema's" % text)
        return "HTTP_%d" % status

    def case_anthropic_stream(self, stub, rng):
        status, lines = http_stream(self.server, "/v1/messages", {
            "model": rng.choice(["demo-lm", ALIAS]), "max_tokens": 16,
            "stream": True, "temperature": rng.choice([0, 0.8]),
            "messages": [{"role": "user", "content": "Once upon a time"}]})
        if status == 200:
            events = [line[len("event: "):] for line in lines
                      if line.startswith("event: ")]
            events = [e for e in events if e != "ping"]
            expect(events[:2] == ["message_start", "content_block_start"] and
                   events[-3:] == ["content_block_stop", "message_delta",
                                   "message_stop"] and
                   set(events[2:-3]) <= {"content_block_delta"},
                   "Anthropic events %s" % events)
        return "HTTP_%d" % status

    def case_http_bad(self, stub, rng):
        body, field = rng.choice([
            (b'{"model": "demo-lm", "prompt": ', "JSON"),
            ({"model": "demo-lm", "prompt": "x", "temperature": 7},
             "temperature"),
            ({"model": "demo-lm", "prompt": "x", "activation_ratio": 2},
             "activation_ratio"),
        ])
        status, answer = http_call(self.server, "POST", "/v1/completions",
                                   body)
        message = answer["error"]["message"] if isinstance(answer, dict) else ""
        expect(field in message, "bad body: %r does not name %s" %
               (message, field))
        return "HTTP_%d" % status

    def case_tokenize(self, stub, rng):
        case = rng.choice(self.lm["cases"])
        status, body = http_call(self.server, "POST", "/tokenize", {
            "model": "demo-lm", "prompt": case["prompt"]})
        if status != 200:
            return "HTTP_%d" % status
        expect(body["tokens"] == case["prompt_ids"],
               "tokenize %r: %s, want %s" % (case["prompt"], body["tokens"],
                                             case["prompt_ids"]))
        status, body = http_call(self.server, "POST", "/detokenize", {
            "model": "demo-lm", "tokens": case["prompt_ids"][1:]})
        if status == 200:
            expect(body["prompt"] == case["prompt"],
                   "detokenize: %r, want %r" % (body["prompt"], case["prompt"]))
        return "HTTP_%d" % status

    def case_metadata(self, stub, rng):
        """ListModels, GET /v1/models, /health and a scrape of /metrics."""
        models = stub.ListModels(self.pb.ListModelsRequest(), timeout=60).models
        expect(sorted(m.name for m in models) == MODEL_NAMES and
               all(m.state == self.pb.ModelInfo.READY for m in models),
               "ListModels: %s" % [(m.name, m.state) for m in models])
        status, body = http_call(self.server, "GET", "/v1/models")
        expect(status == 200 and
               sorted(m["id"] for m in body["data"]) == MODEL_NAMES,
               "GET /v1/models: %s %s" % (status, body))
        status, _ = http_call(self.server, "GET", "/health")
        expect(status == 200, "GET /health: %s" % status)
        samples = self.server.samples()
        expect(lib.metric_value(samples, "moh_requests_running",
                                model="demo-lm") is not None,
               "/metrics without moh_requests_running")
        return OK


def completion_answer(body):
    """What a greedy completion must repeat: its text and tokens."""
    choice = body["choices"][0]
    return choice["text"], (choice.get("logprobs") or {}).get("tokens")


def first_of_each(wrong):
    """Per case: how many were wrong, and the first of them (shortened)."""
    first, count = {}, {}
    for case, problem in wrong:
        first.setdefault(case, problem)
        count[case] = count.get(case, 0) + 1
    return "".join("; %s x%d, first: %s" % (case, count[case], first[case][:300])
                   for case in sorted(first))


def process_figures(pid):
    with open("/proc/%d/status" % pid) as f:
        rss = [int(line.split()[1]) for line in f
               if line.startswith("VmRSS:")][0] * 1024
    return rss, len(os.listdir("/proc/%d/fd" % pid))


def fault_env(args):
    """The server's environment for the out-of-memory faults asked for."""
    if args.memory_tokens < 0:
        return {}
    return {"MOH_TEST_OUT_OF_MEMORY_OVER_TOKENS": str(args.memory_tokens),
            "MOH_TEST_OUT_OF_MEMORY_OVER_BATCH": str(args.memory_images)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=600)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--device", default="cpu",
        help="the models' device; on cuda (bfloat16) the answers are checked "
        "for their form, not against the float32 goldens")
    parser.add_argument(
        "--cuda_paths_off", default=None,
        help="demo-lm's CUDA paths switched off (comma-separated, "
        "bench/cuda_paths.py; default $MOH_CUDA_PATHS_OFF)")
    parser.add_argument(
        "--memory_tokens", type=int, default=32,
        help="demo-lm's steps of more than this many tokens run out of memory "
        "(injected), and demo-vit's Classify batches of more than "
        "--memory_images images; -1: no such fault")
    parser.add_argument("--memory_images", type=int, default=2)
    args = parser.parse_args()
    try:
        off = paths_off(args.cuda_paths_off)
    except ValueError as e:
        parser.error("--cuda_paths_off: %s" % e)
    args.cuda_paths_off = ",".join(off)
    paths = path_config(off)
    # Stopped from outside (a timeout): the server goes too, as on any exit.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    exact = args.device == "cpu"
    device = "" if exact else "device: %s " % json.dumps(args.device)
    workdir = tempfile.mkdtemp(prefix="moh-soak-")
    pb, stubs = load_api(workdir)
    server = lib.MohServer("soak", workdir, [
        ("demo-lm", os.path.join(MODELS, "demo-lm"),
         device + "generation { max_running: 8%s } aliases { name: %s "
         "activation_ratio: 0.5 }" % (paths, json.dumps(ALIAS))),
        ("demo-vit", os.path.join(MODELS, "demo-vit"), device),
        ("demo-dit", os.path.join(MODELS, "demo-dit"),
         device + "generation { max_running: 4 }"),
    ], threads=1, http=True, env=fault_env(args))
    status = 1
    try:
        server.start()
        soak = Soak(server, pb, stubs, exact)
        if exact:
            soak.record_references()
        status = run_soak(args, soak)
        return status
    finally:
        if status != 0:
            # The log goes with the work directory: its sanitizer reports
            # and its end.
            log = server.log().splitlines()
            reports = [line for line in log
                       if "Sanitizer" in line or "runtime error" in line]
            print("\nmoh-server's log (%d lines), last 60:\n%s" % (
                len(log), "\n".join(reports + log[-60:])))
        server.kill()
        shutil.rmtree(workdir, ignore_errors=True)


def run_soak(args, soak):
    server = soak.server
    before = server.samples()
    counted_before = lib.metric_value(before, "moh_requests_total")

    def prefix_tokens(samples):
        return [lib.metric_value(samples, "moh_prefix_cache_%s_total" % kind,
                                 model="demo-lm") or 0
                for kind in ("queries", "hits")]

    codes, wrong = {}, []
    lock = threading.Lock()
    stop_at = time.monotonic() + args.duration

    def client(index):
        rng = random.Random(args.seed * 1000 + index)
        stub = soak.stubs.InferenceStub(server.new_channel())
        while time.monotonic() < stop_at:
            case = rng.choice(sorted(ALLOWED))
            try:
                code, problem = soak.run(case, stub, rng), None
            except Wrong as e:
                code, problem = "wrong answer", str(e)
            with lock:
                codes[(case, code)] = codes.get((case, code), 0) + 1
                if problem:
                    wrong.append((case, problem))
                elif code not in ALLOWED[case]:
                    wrong.append((case, "ended " + code))

    threads = [threading.Thread(target=client, args=(i,), daemon=True)
               for i in range(args.clients)]
    for t in threads:
        t.start()
    time.sleep(args.duration / 5)
    warm_rss, warm_fds = process_figures(server.proc.pid)
    for t in threads:
        t.join()
    end_rss, end_fds = process_figures(server.proc.pid)
    runs = sum(codes.values())
    sent = sum(n * COUNTED.get(case, 1) for (case, _), n in codes.items())
    # A call whose 50 ms deadline passes before it reaches the server (a busy
    # machine) ends DEADLINE_EXCEEDED on the client and is never counted
    # there: the server's count lies between the calls that surely reached it
    # and all calls sent.
    unseen = sum(n for key, n in codes.items() if key in MAY_BE_UNSEEN)

    def counted_now():
        return (lib.metric_value(server.samples(), "moh_requests_total") -
                counted_before)

    lib.wait_until(lambda: counted_now() >= sent - unseen, 30,
                   "the server's count")
    counted = counted_now()
    queried, hits = [after - b for after, b in zip(
        prefix_tokens(server.samples()), prefix_tokens(before))]
    retried = {model: lib.metric_value(server.samples(),
                                       "moh_steps_retried_total", model=model)
               for model in ("demo-lm", "demo-vit")}
    growth = end_rss / warm_rss - 1
    # Last, a drain: SIGTERM, then exit status 0 (under LeakSanitizer, no
    # leak at exit either).
    try:
        status = server.terminate_and_wait(timeout=120)
    except AssertionError:  # killed after the timeout
        status = None
    checks = [
        ("one allowed final status and a right answer per request", not wrong,
         "%d of %d wrong%s" % (len(wrong), runs, first_of_each(wrong))),
        ("server counted every request it received",
         sent - unseen <= counted <= sent,
         "%d counted, %d sent, %d of them past their deadline" %
         (counted, sent, unseen)),
        ("the long prompts hit the prefix cache", hits > 0,
         "%d of %d prompt tokens looked up were cached" % (hits, queried)),
        ("steps out of memory ran again smaller (injected)",
         args.memory_tokens < 0 or retried["demo-lm"] > 0,
         "off" if args.memory_tokens < 0 else
         "demo-lm: %d steps of more than %d tokens, demo-vit: %d batches of "
         "more than %d images" % (retried["demo-lm"], args.memory_tokens,
                                  retried["demo-vit"], args.memory_images)),
        ("RSS growth after warm-up < 5%", growth < 0.05,
         "%.1f MiB -> %.1f MiB (%+.1f%%)" % (warm_rss / 2**20, end_rss / 2**20,
                                            100 * growth)),
        ("no descriptor leak", end_fds <= warm_fds + 2,
         "%d -> %d open fds" % (warm_fds, end_fds)),
        ("drains and exits 0 on SIGTERM", status == 0,
         "exit status %s" % ("none within 120 s" if status is None else
                             status)),
    ]
    print("## Soak: %.0f s, %d clients, %d requests (%.1f/s), %s%s\n" %
          (args.duration, args.clients, runs, runs / args.duration,
           "answers against the goldens" if soak.exact else
           "the models on %s, answers checked for their form" % args.device,
           ", demo-lm's CUDA paths off: " + args.cuda_paths_off
           if args.cuda_paths_off else ""))
    print("| case | final status | requests |\n|---|---|---|")
    for (case, code), n in sorted(codes.items()):
        print("| %s | %s | %d |" % (case, code, n))
    print("\n| check | result | figures |\n|---|---|---|")
    for name, ok, figures in checks:
        print("| %s | %s | %s |" % (name, "ok" if ok else "FAILED", figures))
    return 0 if all(ok for _, ok, _ in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
