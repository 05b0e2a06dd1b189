"""The GPU benchmark's peer computes the official MoH-LLaMA3 math
(bench/moh_peer.py): transformers' LlamaForCausalLM loaded from the
llama_qnorm fixture (the released layout: config.json as released, .bin
shards), with the official query-norm router added, gives the logits the
independent reference (tests/reference/moh_reference.py) gave at the trained
K (golden.json's ratio-0 cases) under eager and SDPA attention, and its
greedy decode through transformers' KV cache gives the golden tokens; without
the router it does not. And gpu_bench.py's peer step runs (on the CPU, small
sizes) and its table sets our ratio 0.75 against the routed peer.

  python moh_peer_test.py FIXTURES_DIR    (the torch wheel's venv: torch,
                                           transformers; CPU is enough)
"""
import json
import os
import subprocess
import sys
import tempfile

import torch
import transformers

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import moh_peer  # noqa: E402


def load(fixture, attn):
    model = transformers.LlamaForCausalLM.from_pretrained(
        fixture, dtype=torch.float32, attn_implementation=attn).eval()
    shared, routed = moh_peer.official_routing(model.config.num_attention_heads)
    return model, moh_peer.add_official_router(model, shared, routed)


def check(fixture):
    with open(os.path.join(fixture, "golden.json")) as f:
        golden = json.load(f)
    cases = [c for c in golden["cases"] if c["ratio"] == 0.0]
    assert cases, "no default-ratio case in golden.json"
    failures = []
    for attn in ("eager", "sdpa"):
        model, hooks = load(fixture, attn)
        for case in cases:
            ids = torch.tensor([golden["prompts"][case["prompt"]]])
            want = torch.tensor(case["logits"])
            with torch.no_grad():
                got = model(ids).logits[0]
                greedy = model.generate(
                    ids, max_new_tokens=len(case["greedy"]),
                    min_new_tokens=len(case["greedy"]), do_sample=False,
                    pad_token_id=0)[0, ids.shape[1]:].tolist()
            scale = max(1.0, want.abs().max().item())
            error = (got - want).abs().max().item() / scale
            what = "%s, prompt %d" % (attn, case["prompt"])
            print("%s: largest logit error %.2e of the largest logit" % (what, error))
            if not error < 1e-4:
                failures.append("%s: logits %.2e from the reference's" % (what, error))
            if greedy != case["greedy"]:
                failures.append("%s: greedy %s, the reference's %s" % (
                    what, greedy, case["greedy"]))
        # The router matters here: without it the logits are another model's.
        for handle in hooks:
            handle.remove()
        case = cases[0]
        with torch.no_grad():
            dense = model(torch.tensor([golden["prompts"][case["prompt"]]])).logits[0]
        apart = (dense - torch.tensor(case["logits"])).abs().max().item()
        print("%s without the router: %.3f from the reference" % (attn, apart))
        if not apart > 1e-2:
            failures.append("%s: the router changes nothing (%.2e)" % (attn, apart))
    return failures


def check_bench(fixture):
    """gpu_bench.py's peer step on the CPU (small sizes), and its table."""
    bench = os.path.join(os.path.dirname(__file__), "..", "bench", "gpu_bench.py")
    run = subprocess.run([sys.executable, bench, "--hf_peer", fixture,
                          "--device", "cpu", "--quick"], capture_output=True,
                         text=True, timeout=300)
    if run.returncode != 0:
        return ["gpu_bench.py --hf_peer: %s" % run.stderr[-2000:]]
    peer = json.loads(run.stdout.splitlines()[-1])
    failures = []
    for attn in ("sdpa", "eager", "sdpa_moh", "eager_moh"):
        if not peer.get(attn, {}).get("decode_tokens_per_s", 0) > 0:
            failures.append("gpu_bench.py --hf_peer: no %s decode in %s" % (attn, peer))
    if peer.get("router") != {"shared_heads": 4, "routed_top_k": 2}:
        failures.append("gpu_bench.py --hf_peer: router %s" % peer.get("router"))
    peer["layout"] = "1b"
    results = {"transformers_peer": peer, "1b": {"batch1": {
        "1.0": {"decode_tokens_per_s": 100.0},
        "0.75": {"decode_tokens_per_s": 120.0}}}}
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(results, f)
        f.flush()
        table = subprocess.run([sys.executable, bench, "--table", f.name],
                               capture_output=True, text=True, timeout=120).stdout
    want = "transformers %s sdpa (official MoH router) decode b1 @4k | %.1f " \
        "| | | moh 0.75 / it: %.2f |" % (
            peer["transformers"], peer["sdpa_moh"]["decode_tokens_per_s"],
            120.0 / peer["sdpa_moh"]["decode_tokens_per_s"])
    if want not in table:
        failures.append("gpu_bench.py --table lacks %r:\n%s" % (want, table))
    return failures


def main():
    fixture = os.path.join(sys.argv[1], "llama_qnorm")
    transformers.utils.logging.disable_progress_bar()
    print("transformers", transformers.__version__, "torch", torch.__version__)
    failures = check(fixture) + check_bench(fixture)
    for failure in failures:
        print("FAILED:", failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
