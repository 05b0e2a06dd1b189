"""Soak: one moh-server serving the demo models under mixed load.

Client threads loop over a seeded mix of requests for --duration seconds:
streams read to the end, streams the client cancels after two messages,
streams whose deadline passes mid-way, image classification, label scoring,
and bad input (a ratio out of range, a GIF). Checks, printed as a table:
  - every request got one final status of the kind its case allows;
  - the server counted every request it received (moh_requests_total grew
    by the number sent, less at most the calls whose deadline passed before
    they reached it);
  - resident memory after the warm-up (the first fifth) grew less than 5%;
  - open file descriptors did not grow.
Exit status 1 when a check fails.

  python3 bench/soak.py [--duration 600] [--clients 8] [--seed 1]
(after `scripts/build.sh`; the integration tests' helpers start the server).
"""
import argparse
import os
import random
import shutil
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE_DIR = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(SOURCE_DIR, "tests", "integration"))

import grpc  # noqa: E402

import moh_testdata  # noqa: E402
import moh_testlib as lib  # noqa: E402

GIF_1X1 = (b"GIF89a\x01\x00\x01\x00\x80\x00\x00\xff\xff\xff\x00\x00\x00"
           b"!\xf9\x04\x01\x00\x00\x00\x00,\x00\x00\x00\x00\x01\x00\x01"
           b"\x00\x00\x02\x02D\x01\x00;")
OK = grpc.StatusCode.OK
# Each case: the codes its final status may have.
ALLOWED = {
    "stream": {OK},
    "cancel": {grpc.StatusCode.CANCELLED, OK},
    "deadline": {grpc.StatusCode.DEADLINE_EXCEEDED, OK},
    "image": {OK},
    "labels": {OK},
    "bad_ratio": {grpc.StatusCode.INVALID_ARGUMENT},
    "bad_image": {grpc.StatusCode.INVALID_ARGUMENT},
}


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


def run_case(case, pb, stub, rng):
    """Sends one request of `case`; returns its final status code."""
    try:
        if case in ("stream", "cancel", "deadline", "bad_ratio"):
            request = lib.generate_request(
                pb, prompt="Once upon a time",
                max_new_tokens=200 if case == "deadline" else 24,
                ratio=7.0 if case == "bad_ratio" else rng.choice([0.0, 0.5]),
                temperature=rng.choice([0.0, 0.8]), seed=rng.randrange(1000))
            timeout = 0.05 if case == "deadline" else 60
            call = stub.Generate(request, timeout=timeout)
            if case == "cancel":
                next(call)
                next(call)
                call.cancel()
            for _ in call:
                pass
            return OK
        if case == "labels":
            stub.Classify(pb.ClassifyRequest(
                model="demo-lm", text="the owl said", labels=["yes", "no"]),
                timeout=60)
            return OK
        image = (GIF_1X1 if case == "bad_image" else moh_testdata.encode_png(
            [[[rng.random() for _ in range(16)] for _ in range(16)]
             for _ in range(3)]))
        stub.Classify(pb.ClassifyRequest(model="demo-vit", image=image),
                      timeout=60)
        return OK
    except StopIteration:
        return OK  # a stream shorter than two messages
    except grpc.RpcError as e:
        return e.code()


def process_figures(pid):
    with open("/proc/%d/status" % pid) as f:
        rss = [int(line.split()[1]) for line in f
               if line.startswith("VmRSS:")][0] * 1024
    return rss, len(os.listdir("/proc/%d/fd" % pid))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=600)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    workdir = tempfile.mkdtemp(prefix="moh-soak-")
    pb, stubs = load_api(workdir)
    models = os.path.join(SOURCE_DIR, "models")
    server = lib.MohServer("soak", workdir, [
        ("demo-lm", os.path.join(models, "demo-lm"),
         "generation { max_running: 8 }"),
        ("demo-vit", os.path.join(models, "demo-vit"), ""),
    ], threads=1)
    try:
        server.start()
        return soak(args, server, pb, stubs)
    finally:
        server.kill()
        shutil.rmtree(workdir, ignore_errors=True)


def soak(args, server, pb, stubs):
    counted_before = lib.metric_value(server.samples(), "moh_requests_total")
    codes, wrong = {}, []
    lock = threading.Lock()
    stop_at = time.monotonic() + args.duration

    def client(index):
        rng = random.Random(args.seed * 1000 + index)
        stub = stubs.InferenceStub(server.new_channel())
        while time.monotonic() < stop_at:
            case = rng.choice(sorted(ALLOWED))
            code = run_case(case, pb, stub, rng)
            with lock:
                codes[(case, code.name)] = codes.get((case, code.name), 0) + 1
                if code not in ALLOWED[case]:
                    wrong.append((case, code.name))

    threads = [threading.Thread(target=client, args=(i,))
               for i in range(args.clients)]
    for t in threads:
        t.start()
    time.sleep(args.duration / 5)
    warm_rss, warm_fds = process_figures(server.proc.pid)
    for t in threads:
        t.join()
    end_rss, end_fds = process_figures(server.proc.pid)
    sent = sum(codes.values())
    # A call whose 50 ms deadline passes before it reaches the server (a busy
    # machine) ends DEADLINE_EXCEEDED on the client and is never counted
    # there: the server's count lies between the calls that surely reached it
    # and all calls sent.
    unseen = sum(n for (case, code), n in codes.items()
                 if case == "deadline" and code == "DEADLINE_EXCEEDED")

    def counted_now():
        return (lib.metric_value(server.samples(), "moh_requests_total") -
                counted_before)

    lib.wait_until(lambda: counted_now() >= sent - unseen, 30,
                   "the server's count")
    counted = counted_now()
    growth = end_rss / warm_rss - 1
    checks = [
        ("one allowed final status per request", not wrong,
         "%d of %d unexpected %s" % (len(wrong), sent, sorted(set(wrong)))),
        ("server counted every request it received",
         sent - unseen <= counted <= sent,
         "%d counted, %d sent, %d of them past their deadline" %
         (counted, sent, unseen)),
        ("RSS growth after warm-up < 5%", growth < 0.05,
         "%.1f MiB -> %.1f MiB (%+.1f%%)" % (warm_rss / 2**20, end_rss / 2**20,
                                            100 * growth)),
        ("no descriptor leak", end_fds <= warm_fds + 2,
         "%d -> %d open fds" % (warm_fds, end_fds)),
    ]
    print("## Soak: %.0f s, %d clients, %d requests (%.1f/s)\n" %
          (args.duration, args.clients, sent, sent / args.duration))
    print("| case | final status | requests |\n|---|---|---|")
    for (case, code), n in sorted(codes.items()):
        print("| %s | %s | %d |" % (case, code, n))
    print("\n| check | result | figures |\n|---|---|---|")
    for name, ok, figures in checks:
        print("| %s | %s | %s |" % (name, "ok" if ok else "FAILED", figures))
    return 0 if all(ok for _, ok, _ in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
