"""Measures the shipped demo models through a running moh-server (gRPC only, no torch).

Used by training/quality_vs_ratio.py (the README table) and by
tests/integration/test_demo_models.py (the serving regression test), so that both
measure the same way:

  digits accuracy  Classify(model=demo-vit, pixels=[1, 8, 8] values/16) over
                   models/demo-vit/heldout.json; correct when the top class is the label.
  bits per byte    Classify(model=demo-lm, text=context, labels=[continuation]) over
                   models/demo-lm/eval_chunks.json: the server returns
                   log p(continuation | <|begin_of_text|> context); bits/byte =
                   -sum(log-likelihoods) / bytes of the continuations / ln 2. Contexts and
                   continuations are split at a space, where tokenizing them apart equals
                   tokenizing them together, so this is the model's real bits per byte.
  generated digits GenerateImage(model=demo-dit, class c, seed c * seed_stride + i) at the
                   model's default steps and guidance, then Classify(model=demo-vit,
                   image=the PNG it returned); correct when the top class is c.
"""
import json
import math
import os
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MODELS = os.path.join(REPO, "models")
SERVICE = "/moh.v1.Inference/"
IN_FLIGHT = 16  # concurrent requests (lets the server batch them)
TIMEOUT = 120.0


def read_json(*parts):
    with open(os.path.join(*parts)) as f:
        return json.load(f)


def heldout_digits(models_dir=MODELS):
    """(pixel lists of 64 floats in [0, 1], integer labels) of the held-out split."""
    d = read_json(models_dir, "demo-vit", "heldout.json")
    return [[v / 16.0 for v in row] for row in d["values"]], d["labels"]


def classify_call(channel, pb):
    return channel.unary_unary(SERVICE + "Classify",
                               request_serializer=pb.ClassifyRequest.SerializeToString,
                               response_deserializer=pb.ClassifyResponse.FromString)


def _run_all(call, requests):
    """Responses in order, at most IN_FLIGHT outstanding."""
    responses, pending = [None] * len(requests), []
    for i, request in enumerate(requests):
        pending.append((i, call.future(request, timeout=TIMEOUT)))
        if len(pending) >= IN_FLIGHT:
            j, future = pending.pop(0)
            responses[j] = future.result()
    for j, future in pending:
        responses[j] = future.result()
    return responses


def pixels_request(pb, pixels, ratio, model="demo-vit", top_n=0):
    request = pb.ClassifyRequest(model=model, top_n=top_n)
    request.pixels.shape.extend([1, 8, 8])
    request.pixels.data.extend(pixels)
    request.activation.ratio = ratio
    return request


def digits_accuracy(channel, pb, images, labels, ratio, model="demo-vit"):
    """(accuracy, mean effective activation ratio) at `ratio` (0 = the trained one)."""
    responses = _run_all(classify_call(channel, pb),
                         [pixels_request(pb, p, ratio, model, top_n=1) for p in images])
    correct = sum(int(r.classes[0].label) == y for r, y in zip(responses, labels))
    effective = sum(r.effective_activation_ratio for r in responses) / len(responses)
    return correct / len(labels), effective


def chunk_log_likelihoods(channel, pb, chunks, ratio, model="demo-lm"):
    """log p(continuation | context) of every chunk, from label scoring."""
    requests = []
    for c in chunks:
        request = pb.ClassifyRequest(model=model, text=c["context"])
        request.labels.append(c["continuation"])
        request.activation.ratio = ratio
        requests.append(request)
    responses = _run_all(classify_call(channel, pb), requests)
    return [r.classes[0].log_likelihood for r in responses], [
        r.effective_activation_ratio for r in responses]


def bits_per_byte(channel, pb, eval_chunks, ratio, model="demo-lm"):
    """(bits per byte, mean effective ratio) over eval_chunks.json's chunks."""
    ll, effective = chunk_log_likelihoods(channel, pb, eval_chunks["chunks"], ratio, model)
    n_bytes = sum(len(c["continuation"].encode()) for c in eval_chunks["chunks"])
    return -sum(ll) / n_bytes / math.log(2), sum(effective) / len(effective)


def image_request(pb, class_index, seed, ratio, steps=0, guidance=None, model="demo-dit"):
    """A GenerateImageRequest (steps 0 and guidance None: the model's defaults)."""
    request = pb.GenerateImageRequest(model=model, class_index=class_index, seed=seed,
                                      steps=steps)
    if guidance is not None:
        request.guidance_scale = guidance
    request.activation.ratio = ratio
    return request


def generate_images(channel, pb, requests):
    """The last GenerateImageResponse (PNG and all) of each request, in order, at most
    IN_FLIGHT outstanding (the server batches them step by step)."""
    call = channel.unary_stream(SERVICE + "GenerateImage",
                                request_serializer=pb.GenerateImageRequest.SerializeToString,
                                response_deserializer=pb.GenerateImageResponse.FromString)

    def last(request):
        response = None
        for response in call(request, timeout=TIMEOUT):
            pass
        return response

    with ThreadPoolExecutor(IN_FLIGHT) as pool:
        return list(pool.map(last, requests))


def generated_digits_accuracy(channel, pb, ratio, per_class, seed_stride=None, classes=10,
                              model="demo-dit", classifier="demo-vit"):
    """(accuracy, [accuracy per class], mean effective ratio) of `model`'s digits at `ratio`
    as read by `classifier`, both through the server: class c, image i has seed
    c * seed_stride + i (seed_stride defaults to per_class, training/dit_quality.py's seeds)."""
    stride = seed_stride or per_class
    labels = [c for c in range(classes) for _ in range(per_class)]
    images = generate_images(channel, pb, [
        image_request(pb, c, c * stride + i, ratio, model=model)
        for c in range(classes) for i in range(per_class)])
    read = _run_all(classify_call(channel, pb), [
        pb.ClassifyRequest(model=classifier, image=r.png, top_n=1) for r in images])
    correct = [r.classes[0].index == y for r, y in zip(read, labels)]
    per = [sum(correct[c * per_class:(c + 1) * per_class]) / per_class for c in range(classes)]
    effective = sum(r.effective_activation_ratio for r in images) / len(images)
    return sum(correct) / len(correct), per, effective
