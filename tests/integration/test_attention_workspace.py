"""generation.attention_workspace_mb through the real server: the dense
attention path (here: bfloat16 on CPU with every head, as on CUDA) runs a long
text in query chunks under a 1 MiB workspace and scores it as with the default
256 MiB one in a single chunk.

1500 bytes of text against up to 1500 keys over 8 heads need about 33 B per key
per query: 1 MiB holds about 20 queries, so the small workspace takes dozens of
chunks where the default takes one."""
import os
import subprocess

import pytest

import moh_testlib as lib

MODELS = {"ws-default": "", "ws-1mib": "attention_workspace_mb: 1"}


@pytest.fixture(scope="module")
def server(start_server, long_lm_dir):
    return start_server("workspace", [
        (name, long_lm_dir,
         'dtype: "bfloat16" generation { max_running: 2 max_seq_len: 2048 %s }'
         % extra) for name, extra in MODELS.items()
    ])


def test_small_workspace_scores_like_the_default(server, api):
    stub = api.grpc.InferenceStub(server.channel())
    text = " ".join("word%d" % (i % 97) for i in range(220))[:1500]
    labels = [" word1", " word42 word43", " zzz"]
    scores = {}
    for model in MODELS:
        response = stub.Classify(
            api.pb.ClassifyRequest(model=model, text=text, labels=labels,
                                   activation=api.pb.Activation(ratio=1.0)),
            timeout=lib.RPC_TIMEOUT)
        assert response.effective_activation_ratio == pytest.approx(1.0)
        scores[model] = {c.label: c.log_likelihood for c in response.classes}
    for label in labels:
        # bfloat16 rounding differs between chunk shapes; the log-likelihoods
        # agree to a few parts in a thousand.
        assert scores["ws-1mib"][label] == pytest.approx(
            scores["ws-default"][label], rel=0.01, abs=0.05), (label, scores)


def test_out_of_range_workspace_is_refused(workdir, long_lm_dir):
    config = os.path.join(workdir, "workspace-bad.textproto")
    with open(config, "w") as f:
        f.write('models { name: "lm" model_dir: "%s" '
                'generation { attention_workspace_mb: 70000 } }\n' % long_lm_dir)
    run = subprocess.run([lib.SERVER, "--config=" + config], capture_output=True,
                         text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert run.returncode == 2, run
    assert ("models[0].generation.attention_workspace_mb must be in [1, 65536]"
            in run.stdout + run.stderr), run
