#!/usr/bin/python3
"""A small Python client for moh-server (the moh.v1.Inference gRPC API).

An example for users of languages other than C++: it needs only grpcio and
protobuf, plus the message module generated from proto/moh/v1/inference.proto
(gen_stubs.sh, or generate_stubs() below; generated code is never kept in git).

    from moh_client import MohClient
    client = MohClient("localhost:50051", stub_dir="build/python")
    for model in client.list_models():
        print(model.name, model.family, model.state)
    for chunk in client.generate("Once upon a time", max_new_tokens=32):
        print(chunk.text, end="", flush=True)
    # Three samples, each token with its log-probability and 2 alternatives.
    for sample in client.generate_samples("Once", n=3, temperature=0.8,
                                          logprobs=2, max_new_tokens=8):
        print(sample.index, sample.text, sample.logprobs[0].logprob)
    print(client.classify(text="I loved it", labels=["positive", "negative"]))

As a program (Debian: run with /usr/bin/python3, which has grpcio):

    moh_client.py [--server=HOST:PORT] [--stubs=DIR] models
    moh_client.py generate "PROMPT" [--model=M] [--max_new_tokens=N] [--ratio=R]
                  [--n=N] [--logprobs=K] [--priority=P]
    moh_client.py classify IMAGE_FILE [--top_n=N] | --text=T --labels=a,b

RPC errors print "moh_client: <CODE>: <details>" and exit 1; bad usage exits 2.
"""

import argparse
import importlib
import os
import shutil
import subprocess
import sys
import tempfile

import grpc

_PROTO_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                           "..", "proto")
_SERVICE = "/moh.v1.Inference/"


def generate_stubs(out_dir, proto_root=_PROTO_ROOT):
    """Writes out_dir/moh/v1/inference_pb2.py with the system protoc."""
    protoc = os.environ.get("PROTOC") or shutil.which("protoc")
    if protoc is None:
        raise RuntimeError("protoc not found (Debian: protobuf-compiler)")
    os.makedirs(out_dir, exist_ok=True)
    subprocess.run([
        protoc, "--proto_path=" + proto_root, "--python_out=" + out_dir,
        os.path.join(proto_root, "moh", "v1", "inference.proto")
    ],
                   check=True)
    return out_dir


def load_api(stub_dir=None):
    """Returns the moh.v1 message module, generating it when needed.

    With stub_dir, that directory is put first on sys.path and the module is
    generated there if it is missing; without, an importable module is used
    as is, else one is generated into a fresh temporary directory.
    """
    if stub_dir is None:
        try:
            return importlib.import_module("moh.v1.inference_pb2")
        except ImportError:
            stub_dir = tempfile.mkdtemp(prefix="moh_stubs_")
    stub_dir = os.path.abspath(stub_dir)
    if not os.path.exists(
            os.path.join(stub_dir, "moh", "v1", "inference_pb2.py")):
        generate_stubs(stub_dir)
    if stub_dir not in sys.path:
        sys.path.insert(0, stub_dir)
    importlib.invalidate_caches()
    return importlib.import_module("moh.v1.inference_pb2")


def build_generate_request(pb,
                           prompt=None,
                           token_ids=None,
                           model="",
                           max_new_tokens=None,
                           temperature=None,
                           top_k=0,
                           top_p=None,
                           seed=None,
                           stop=(),
                           repetition_penalty=None,
                           min_p=0.0,
                           presence_penalty=0.0,
                           frequency_penalty=0.0,
                           logprobs=None,
                           prompt_logprobs=None,
                           logit_bias=None,
                           n=1,
                           priority=0,
                           ratio=0.0,
                           min_ratio=0.0,
                           include_routing=False):
    """A GenerateRequest; None leaves an optional sampling field unset.

    logprobs=K returns each generated token's log-probability with the K most
    likely alternatives (0..20); prompt_logprobs=K the same for the prompt.
    n samples share one prefill; their messages carry `index`.
    logit_bias={token_id: bias} adds each bias (in [-100, 100]) to its token's
    logit before sampling.
    """
    if (prompt is None) == (not token_ids):
        raise ValueError("give exactly one of prompt or token_ids")
    request = pb.GenerateRequest(model=model,
                                 include_routing=include_routing,
                                 n=n,
                                 priority=priority)
    if prompt is not None:
        request.prompt = prompt
    request.token_ids.extend(token_ids or [])
    sampling = request.sampling
    for name, value in (("max_new_tokens", max_new_tokens),
                        ("temperature", temperature), ("top_p", top_p),
                        ("seed", seed),
                        ("repetition_penalty", repetition_penalty),
                        ("logprobs", logprobs),
                        ("prompt_logprobs", prompt_logprobs)):
        if value is not None:
            setattr(sampling, name, value)
    sampling.min_p = min_p
    sampling.presence_penalty = presence_penalty
    sampling.frequency_penalty = frequency_penalty
    sampling.top_k = top_k
    sampling.stop.extend(stop)
    for token, bias in (logit_bias or {}).items():
        sampling.logit_bias[token] = bias
    request.activation.ratio = ratio
    request.activation.min_ratio = min_ratio
    return request


def build_classify_request(pb,
                           image=None,
                           text=None,
                           labels=(),
                           model="",
                           top_n=0,
                           ratio=0.0,
                           min_ratio=0.0,
                           include_routing=False):
    """A ClassifyRequest for encoded image bytes, or text with labels."""
    if (image is None) == (text is None):
        raise ValueError("give exactly one of image or text")
    request = pb.ClassifyRequest(model=model,
                                 top_n=top_n,
                                 include_routing=include_routing)
    if image is not None:
        request.image = image
    else:
        request.text = text
    request.labels.extend(labels)
    request.activation.ratio = ratio
    request.activation.min_ratio = min_ratio
    return request


class MohClient:
    """A connection to moh-server. Methods raise grpc.RpcError on failure."""

    def __init__(self, target="localhost:50051", timeout=None, stub_dir=None,
                 tls_ca=None, tls_cert=None, tls_key=None, token=None):
        """tls_ca: PEM bytes of the CA to trust (TLS); tls_cert, tls_key: a
        client certificate (mutual TLS); token: a bearer token."""
        self.pb = load_api(stub_dir)
        self.timeout = timeout
        self.metadata = ([("authorization", "Bearer " + token)]
                         if token else None)
        if tls_ca is None:
            self.channel = grpc.insecure_channel(target)
        else:
            self.channel = grpc.secure_channel(
                target, grpc.ssl_channel_credentials(
                    root_certificates=tls_ca, private_key=tls_key,
                    certificate_chain=tls_cert))
        pb = self.pb
        self._list_models = self.channel.unary_unary(
            _SERVICE + "ListModels",
            request_serializer=pb.ListModelsRequest.SerializeToString,
            response_deserializer=pb.ListModelsResponse.FromString)
        self._generate = self.channel.unary_stream(
            _SERVICE + "Generate",
            request_serializer=pb.GenerateRequest.SerializeToString,
            response_deserializer=pb.GenerateResponse.FromString)
        self._classify = self.channel.unary_unary(
            _SERVICE + "Classify",
            request_serializer=pb.ClassifyRequest.SerializeToString,
            response_deserializer=pb.ClassifyResponse.FromString)

    def close(self):
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def list_models(self):
        """The hosted models: a list of moh.v1.ModelInfo."""
        return list(
            self._list_models(self.pb.ListModelsRequest(),
                              timeout=self.timeout,
                              metadata=self.metadata).models)

    def generate(self, prompt=None, **kwargs):
        """Streams GenerateResponse messages (see build_generate_request).

        The returned iterator is also the call: its cancel() stops the
        generation on the server.
        """
        request = build_generate_request(self.pb, prompt, **kwargs)
        return self._generate(request, timeout=self.timeout,
                              metadata=self.metadata)

    def generate_samples(self, prompt=None, **kwargs):
        """Runs Generate to its end and returns one Sample per index (n of
        them), each with its whole text, token ids, log-probabilities (when
        asked) and last message (finish reason, usage, ratios)."""
        samples = {}
        for m in self.generate(prompt, **kwargs):
            sample = samples.setdefault(m.index, Sample(m.index))
            sample.add(m)
        return [samples[i] for i in sorted(samples)]

    def classify(self, **kwargs):
        """A ClassifyResponse (see build_classify_request)."""
        request = build_classify_request(self.pb, **kwargs)
        return self._classify(request, timeout=self.timeout,
                              metadata=self.metadata)


class Sample:
    """One sample of a Generate stream, put together."""

    def __init__(self, index):
        self.index = index
        self.text = ""
        self.token_ids = []
        self.logprobs = []         # moh.v1.TokenLogprob per generated token
        self.prompt_logprobs = []  # per prompt token after the first
        self.last = None           # the message with the finish reason

    def add(self, message):
        self.text += message.text
        self.token_ids.extend(message.token_ids)
        self.logprobs.extend(message.logprobs)
        self.prompt_logprobs.extend(message.prompt_logprobs)
        if message.finish_reason:
            self.last = message


def _print_models(models, pb):
    for m in models:
        heads = ",".join(
            "%d/%d/%d" % (l.num_heads, l.shared_heads, l.routed_heads)
            for l in m.layers)
        print("%-20s %-6s %-10s ratio %.3f (min %.3f) %s %s kv %s max_seq %d"
              " %s %s"
              % (m.name, m.family, m.router, m.default_ratio, m.min_ratio,
                 m.device, m.dtype, m.kv_cache_dtype or "-", m.max_seq_len,
                 pb.ModelInfo.State.Name(m.state), m.failure_reason))
        print("    heads/shared/routed per layer: " + (heads or "-"))


def _run(args, client):
    pb = client.pb
    if args.command == "models":
        _print_models(client.list_models(), pb)
        return 0
    activation = dict(ratio=args.ratio, min_ratio=args.min_ratio)
    if args.command == "generate":
        request = dict(model=args.model,
                       max_new_tokens=args.max_new_tokens,
                       temperature=args.temperature,
                       seed=args.seed,
                       n=args.n,
                       logprobs=args.logprobs,
                       priority=args.priority,
                       **activation)
    if args.command == "generate" and (args.n > 1 or
                                       args.logprobs is not None):
        for s in client.generate_samples(args.prompt, **request):
            print("[%d] %s" % (s.index, s.text))
            for e in s.logprobs:
                alternatives = " ".join("%r:%.3f" % (t.token, t.logprob)
                                        for t in e.top_logprobs)
                print("    %-16r %8.4f  %s" % (e.token, e.logprob,
                                               alternatives))
            print("[%d] finish_reason: %s, %d tokens" %
                  (s.index, pb.FinishReason.Name(s.last.finish_reason),
                   s.last.usage.completion_tokens), file=sys.stderr)
        return 0
    if args.command == "generate":
        last = None
        call = client.generate(args.prompt, **request)
        try:
            for last in call:
                sys.stdout.write(last.text)
                sys.stdout.flush()
        except KeyboardInterrupt:
            call.cancel()
            return 130
        sys.stdout.write("\n")
        if last is not None:
            print("finish_reason: %s, usage: %d + %d tokens, activation "
                  "%.3f (ratio %.3f)" %
                  (pb.FinishReason.Name(last.finish_reason),
                   last.usage.prompt_tokens, last.usage.completion_tokens,
                   last.effective_activation_ratio, last.activation_ratio),
                  file=sys.stderr)
        return 0
    if (args.image is None) == (args.text is None):
        raise ValueError("classify needs IMAGE_FILE or --text")
    image = None
    if args.image is not None:
        with open(args.image, "rb") as f:
            image = f.read()
    labels = args.labels.split(",") if args.labels else []
    response = client.classify(image=image,
                               text=args.text,
                               labels=labels,
                               model=args.model,
                               top_n=args.top_n,
                               **activation)
    for c in response.classes:
        print("%-24s %5d %.4f %.4f" %
              (c.label, c.index, c.score, c.log_likelihood))
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(prog="moh_client.py",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--server", default="localhost:50051")
    parser.add_argument("--timeout", type=float, default=None)
    parser.add_argument("--stubs",
                        default=None,
                        help="directory for the generated message module")
    parser.add_argument("--tls_ca", default=None,
                        help="connect over TLS, trusting this PEM CA")
    parser.add_argument("--tls_cert", default=None,
                        help="mutual TLS: this client's PEM certificate")
    parser.add_argument("--tls_key", default=None,
                        help="mutual TLS: this client's PEM key")
    parser.add_argument("--token_file", default=None,
                        help="send the bearer token in this file's first line")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("models", help="list the hosted models")
    gen = sub.add_parser("generate", help="stream a completion")
    gen.add_argument("prompt")
    gen.add_argument("--max_new_tokens", type=int, default=None)
    gen.add_argument("--temperature", type=float, default=None)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--n", type=int, default=1,
                     help="samples, sharing one prefill (printed whole)")
    gen.add_argument("--logprobs", type=int, default=None,
                     help="print each token's log-probability and K "
                     "alternatives")
    gen.add_argument("--priority", type=int, default=0)
    cls = sub.add_parser("classify", help="classify an image or score labels")
    cls.add_argument("image", nargs="?", default=None)
    cls.add_argument("--text", default=None)
    cls.add_argument("--labels", default="")
    cls.add_argument("--top_n", type=int, default=0)
    for p in (gen, cls):
        p.add_argument("--model", default="")
        p.add_argument("--ratio", type=float, default=0.0)
        p.add_argument("--min_ratio", type=float, default=0.0)
    args = parser.parse_args(argv)

    def read(path):
        if path is None:
            return None
        with open(path, "rb") as f:
            return f.read()

    token = read(args.token_file)
    token = token.decode().splitlines()[0].strip() if token else None
    try:
        with MohClient(args.server, args.timeout, args.stubs,
                       tls_ca=read(args.tls_ca), tls_cert=read(args.tls_cert),
                       tls_key=read(args.tls_key), token=token) as client:
            return _run(args, client)
    except grpc.RpcError as e:
        print("moh_client: %s: %s" % (e.code().name, e.details()),
              file=sys.stderr)
        return 1
    except ValueError as e:
        parser.print_usage(sys.stderr)
        print("moh_client: %s" % e, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
