#!/usr/bin/python3
"""Quality of the shipped demo models versus activation ratio, measured through moh-server.

Starts moh-server on the demo models (or uses --server HOST:PORT), then for ratios
0.5, 0.625, 0.75, 0.875, 1.0 measures over gRPC (see training/demo_eval.py):
  - demo-vit: accuracy on the 360 held-out digits;
  - demo-lm: bits per byte on held-out KJV chunks (label scoring), next to the unigram
    byte model's bits per byte on the same bytes.
Each is measured per precision of its linear weights (--weights, default all three):
float32 as shipped, and the same checkpoint served with ModelConfig.weights "bfloat16" or
"int8" (converted at load, float32 activations) as demo-lm-bf16 / demo-vit-int8 and so on.
Prints a Markdown table (the README's "Demo models: quality versus activation ratio").

Usage: /usr/bin/python3 training/quality_vs_ratio.py [--server HOST:PORT]
           [--moh_server build/service/moh-server] [--models models] [--threads N]
           [--weights float32,bfloat16,int8 (the default; with --server: float32)]
"""
import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time

import grpc

import demo_eval

sys.path.insert(0, os.path.join(demo_eval.REPO, "client", "python"))
import moh_client  # noqa: E402

RATIOS = [0.5, 0.625, 0.75, 0.875, 1.0]
# ModelConfig.weights -> the served names' suffix.
WEIGHTS = {"float32": "", "bfloat16": "-bf16", "int8": "-int8"}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def variants_config(models, weights, names=("demo-lm", "demo-vit")):
    """A ServerConfig textproto serving the demo models `names` of `models` once per
    precision in `weights` (WEIGHTS' keys), named with its suffix."""
    entries = []
    for w in weights:
        for model in names:
            field = "" if w == "float32" else ' weights: "%s"' % w
            entries.append('models { name: "%s%s" model_dir: "%s"%s }'
                           % (model, WEIGHTS[w], os.path.join(os.path.abspath(models), model),
                              field))
    return "\n".join(entries) + "\n"


def start_server(binary, models, threads, weights=None, names=("demo-lm", "demo-vit")):
    """moh-server on the demo models (--demo_dir), or on the demo models `names` once per
    precision in `weights` (variants_config)."""
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="moh_quality_", suffix=".log", delete=False)
    if weights is None:
        served = ["--demo_dir=" + models]
    else:
        config = tempfile.NamedTemporaryFile("w", prefix="moh_quality_", suffix=".textproto",
                                             delete=False)
        config.write(variants_config(models, weights, names))
        config.close()
        served = ["--config=" + config.name]
    proc = subprocess.Popen([binary] + served + ["--port=%d" % port,
                             "--metrics_port=-1", "--http_port=-1", "--host=127.0.0.1", "--threads=%d" % threads],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return proc, "127.0.0.1:%d" % port, log.name


def wait_ready(client, proc, log_path, timeout=120):
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            sys.exit("moh-server exited (%s); log: %s" % (proc.returncode, log_path))
        try:
            models = {m.name: m for m in client.list_models()}
            if models and all(m.state == client.pb.ModelInfo.READY for m in models.values()):
                return models
        except grpc.RpcError:
            pass
        if time.monotonic() > deadline:
            sys.exit("moh-server not ready after %d s; log: %s" % (timeout, log_path))
        time.sleep(0.2)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", help="a running moh-server serving demo-lm and demo-vit")
    parser.add_argument("--moh_server", default=os.path.join(demo_eval.REPO, "build", "service",
                                                            "moh-server"))
    parser.add_argument("--models", default=demo_eval.MODELS)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--stubs", default=None, help="directory for the generated moh.v1 module")
    parser.add_argument("--weights", default=None,
                        help="precisions of the linear weights, of %s (default: all; with "
                        "--server, float32: a server measured in bfloat16 or int8 serves "
                        "demo-lm-bf16, demo-vit-int8 and so on)" % ", ".join(WEIGHTS))
    args = parser.parse_args()
    weights = (args.weights or ("float32" if args.server else ",".join(WEIGHTS))).split(",")
    for w in weights:
        if w not in WEIGHTS:
            parser.error("--weights: %r is none of %s" % (w, ", ".join(WEIGHTS)))

    proc, log_path, target = None, None, args.server
    if target is None:
        proc, target, log_path = start_server(args.moh_server, args.models, args.threads,
                                              weights)
    try:
        client = moh_client.MohClient(target, timeout=120, stub_dir=args.stubs)
        models = wait_ready(client, proc, log_path)
        pb = client.pb
        images, labels = demo_eval.heldout_digits(args.models)
        chunks = demo_eval.read_json(args.models, "demo-lm", "eval_chunks.json")
        lm_default = models["demo-lm" + WEIGHTS[weights[0]]].default_ratio
        vit_default = models["demo-vit" + WEIGHTS[weights[0]]].default_ratio
        t0 = time.time()
        rows = []
        for r in RATIOS:
            for w in weights:
                acc, vit_eff = demo_eval.digits_accuracy(client.channel, pb, images, labels, r,
                                                         model="demo-vit" + WEIGHTS[w])
                bpb, lm_eff = demo_eval.bits_per_byte(client.channel, pb, chunks, r,
                                                      model="demo-lm" + WEIGHTS[w])
                rows.append((r, w, acc, vit_eff, bpb, lm_eff))
                print("ratio %.3f %s: digits %.4f (effective %.3f), bits/byte %.4f (effective %.3f)"
                      % (r, w, acc, vit_eff, bpb, lm_eff), file=sys.stderr, flush=True)
        seconds = time.time() - t0
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)

    def mark(r, default):
        return " (trained)" if abs(r - default) < 1e-6 else ""

    print("| ratio | weights | demo-vit digits accuracy (%d held-out) | demo-lm bits/byte "
          "(%d held-out bytes) |" % (len(labels), chunks["bytes"]))
    print("|---|---|---|---|")
    for r, w, acc, _, bpb, _ in rows:
        print("| %.3f | %s | %.2f%%%s | %.3f%s |" % (r, w, 100 * acc, mark(r, vit_default), bpb,
                                                   mark(r, lm_default)))
    print("| unigram byte model | | | %.3f |" % chunks["unigram_bits_per_byte"])
    print("\nTrained ratios: demo-vit %.3f, demo-lm %.3f. Measured through moh-server in %.0f s."
          % (vit_default, lm_default, seconds))


if __name__ == "__main__":
    main()
