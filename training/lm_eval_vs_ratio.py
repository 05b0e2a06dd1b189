"""An lm-evaluation-harness task's score against the activation ratio, through moh-server.

Runs EleutherAI's lm-evaluation-harness, unmodified (`lm_eval run --model
local-completions`, the remote tokenizer of moh-server's /tokenize), once per ratio,
against the model aliases that fix it (`<model>@<ratio>`, ModelConfig.aliases): so
any OpenAI tool measures quality against compute the same way. Without --url it starts
moh-server on the model directory with one alias per ratio; with --url, the server
must declare those aliases. Writes, under --out:
  - <ratio>/: lm-eval's results and, with --log_samples, its per-sample records;
  - scores.json: {"ratios": [...], "scores": {task: {metric: [value per ratio]}}};
  - <task>.png: each of the task's metrics against the ratio.
Prints a Markdown table.

Runs in the lm-eval environment (scripts/install_deps.sh --test):
  . scripts/test_venv.env
  $MOH_EVAL_VENV/bin/python training/lm_eval_vs_ratio.py \\
      --tasks moh_kjv_next_word --include_path tests/integration/lm_eval_tasks
"""
import argparse
import glob
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RATIOS = [0.5, 0.625, 0.75, 0.875, 1.0]


def alias(model, ratio):
    return "%s@%g" % (model, ratio)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(binary, model, model_dir, ratios, threads):
    """moh-server on `model_dir` with one alias per ratio: (process, base
    URL, log path)."""
    work = tempfile.mkdtemp(prefix="moh_lm_eval_")
    aliases = "".join(' aliases { name: "%s" activation_ratio: %g }' % (alias(model, r), r)
                      for r in ratios)
    port, http_port = free_port(), free_port()
    config = os.path.join(work, "server.textproto")
    with open(config, "w") as f:
        f.write('port: %d http_port: %d metrics_port: -1 host: "127.0.0.1" threads: %d\n'
                'models { name: "%s" model_dir: "%s"%s }\n'
                % (port, http_port, threads, model, os.path.abspath(model_dir), aliases))
    log = os.path.join(work, "server.log")
    with open(log, "w") as out:
        proc = subprocess.Popen([binary, "--config=" + config], stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return proc, "http://127.0.0.1:%d" % http_port, log


def models_when_ready(url, proc, log, timeout=120):
    """{id: model} of GET /v1/models once every model is READY."""
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            sys.exit("moh-server exited (%s); log: %s" % (proc.returncode, log))
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
                models = {m["id"]: m for m in json.load(r)["data"]}
            if all(m["moh"]["state"] == "READY" for m in models.values()):
                return models
        except OSError:
            pass
        if time.monotonic() > deadline:
            sys.exit("moh-server not ready after %d s; log: %s" % (timeout, log))
        time.sleep(0.2)


def run_lm_eval(args, url, model, out_dir):
    """lm-eval's results JSON for `model` (a ratio's alias)."""
    command = [
        sys.executable, "-m", "lm_eval", "run", "--model", "local-completions",
        "--model_args",
        "model=%s,base_url=%s/v1/completions,tokenizer_backend=remote,"
        "num_concurrent=1,max_retries=1" % (model, url),
        "--tasks", *args.tasks.split(","), "--include_path", args.include_path,
        "--output_path", out_dir, "--batch_size", str(args.batch_size),
    ]
    if args.limit:
        command += ["--limit", str(args.limit)]
    if args.log_samples:
        command.append("--log_samples")
    # The tasks' data are local files, named relative to their folder.
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    subprocess.run(command, cwd=args.include_path, env=env, check=True,
                   timeout=args.timeout)
    found = glob.glob(os.path.join(out_dir, "*", "results_*.json"))
    if len(found) != 1:
        sys.exit("lm_eval wrote %d results files under %s" % (len(found), out_dir))
    with open(found[0]) as f:
        return json.load(f)


def scores_of(results):
    """{task: {metric: value}} of lm-eval's results (stderr left out)."""
    scores = {}
    for task, values in results["results"].items():
        for key, value in values.items():
            metric, _, filter_name = key.partition(",")
            if filter_name and "stderr" not in metric and isinstance(value, (int, float)):
                scores.setdefault(task, {})[metric] = value
    return scores


def plot(task, ratios, metrics, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for metric, values in metrics.items():
        ax.plot(ratios, values, marker="o", label=metric)
    ax.set_xlabel("activation ratio (fraction of heads)")
    ax.set_ylabel("score")
    ax.set_title("%s through moh-server (lm-eval)" % task)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running moh-server's HTTP API, e.g. "
                        "http://127.0.0.1:8000, declaring <model>@<ratio> aliases")
    parser.add_argument("--model", default="demo-lm")
    parser.add_argument("--model_dir", default=os.path.join(REPO, "models", "demo-lm"))
    parser.add_argument("--moh_server", default=os.path.join(REPO, "build", "service",
                                                            "moh-server"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ratios", default=",".join("%g" % r for r in RATIOS))
    parser.add_argument("--tasks", default="moh_kjv_next_word")
    parser.add_argument("--include_path",
                        default=os.path.join(REPO, "tests", "integration", "lm_eval_tasks"))
    parser.add_argument("--limit", type=int, default=0, help="documents per task (0: all)")
    parser.add_argument("--batch_size", type=int, default=8,
                        help="prompts per request (lm-eval's batch form)")
    parser.add_argument("--log_samples", action="store_true")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per lm_eval run")
    parser.add_argument("--out", default="lm_eval_vs_ratio")
    args = parser.parse_args()
    args.include_path = os.path.abspath(args.include_path)
    ratios = [float(r) for r in args.ratios.split(",")]

    proc, log, url = None, None, args.url
    if url is None:
        proc, url, log = start_server(args.moh_server, args.model, args.model_dir, ratios,
                                      args.threads)
    try:
        models = models_when_ready(url, proc, log)
        missing = [alias(args.model, r) for r in ratios if alias(args.model, r) not in models]
        if missing:
            sys.exit("the server has no model %s: declare each in its config, e.g. "
                     'models { ... aliases { name: "%s" activation_ratio: %g } }'
                     % (", ".join(missing), missing[0], ratios[0]))
        os.makedirs(args.out, exist_ok=True)
        per_ratio = []
        for r in ratios:
            results = run_lm_eval(args, url, alias(args.model, r),
                                  os.path.abspath(os.path.join(args.out, "%g" % r)))
            per_ratio.append(scores_of(results))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)

    scores = {}
    for task in per_ratio[0]:
        for metric in per_ratio[0][task]:
            scores.setdefault(task, {})[metric] = [s[task][metric] for s in per_ratio]
    with open(os.path.join(args.out, "scores.json"), "w") as f:
        json.dump({"model": args.model, "ratios": ratios, "scores": scores}, f, indent=1)
    for task, metrics in scores.items():
        plot(task, ratios, metrics, os.path.join(args.out, task + ".png"))
    print("| task | metric | " + " | ".join("ratio %g" % r for r in ratios) + " |")
    print("|---|---|" + "---|" * len(ratios))
    for task, metrics in scores.items():
        for metric, values in metrics.items():
            print("| %s | %s | %s |" % (task, metric, " | ".join("%.4f" % v for v in values)))


if __name__ == "__main__":
    main()
