"""Bad input: the right status code, a message naming the field, and the server
keeps serving (a normal request right after succeeds).

The demo LM has max_seq_len 256 and vocab 320; the demo ViT takes [3, 16, 16]
pixels and has 5 classes.
"""
import json
import os

import grpc
import pytest

import moh_testlib as lib

NAN = float("nan")
PIXELS_OK = dict(shape=[3, 16, 16], data=[0.5] * 768)
INVALID = grpc.StatusCode.INVALID_ARGUMENT
# Valid 1x1 images in formats the API does not promise (only PNG and JPEG).
GIF_1X1 = (b"GIF89a\x01\x00\x01\x00\x80\x00\x00\xff\xff\xff\x00\x00\x00"
           b"!\xf9\x04\x01\x00\x00\x00\x00,\x00\x00\x00\x00\x01\x00\x01"
           b"\x00\x00\x02\x02D\x01\x00;")
BMP_1X1 = (b"BM" + (58).to_bytes(4, "little") + bytes(4) +
           (54).to_bytes(4, "little") + (40).to_bytes(4, "little") +
           (1).to_bytes(4, "little") + (1).to_bytes(4, "little") +
           (1).to_bytes(2, "little") + (24).to_bytes(2, "little") + bytes(4) +
           (4).to_bytes(4, "little") + bytes(16) + b"\x00\x00\xff\x00")


def G(**kwargs):
    """A Generate case: GenerateRequest fields for lib.generate_request."""
    kwargs.setdefault("model", "demo-lm")
    return ("Generate", kwargs)


def C(**kwargs):
    """A Classify case: ClassifyRequest fields (pixels: Tensor kwargs)."""
    kwargs.setdefault("model", "demo-vit")
    return ("Classify", kwargs)


# (id, request, status code, substrings the message must contain)
CASES = [
    # Generate: the input.
    ("no_input", G(), INVALID, ["prompt", "token_ids"]),
    ("empty_prompt", G(prompt=""), INVALID, ["prompt", "token_ids"]),
    ("prompt_and_token_ids", G(prompt="hi", token_ids=[1, 2]), INVALID,
     ["prompt", "token_ids"]),
    ("token_ids_longer_than_max_seq_len", G(token_ids=[5] * 300), INVALID,
     ["token_ids", "255"]),
    ("token_ids_fill_max_seq_len", G(token_ids=[5] * 256), INVALID,
     ["token_ids", "255"]),
    ("prompt_text_too_many_tokens", G(prompt="hello " * 400), INVALID,
     ["prompt", "255"]),
    ("prompt_over_1_MiB", G(prompt="a" * ((1 << 20) + 1)), INVALID,
     ["prompt", "1048576"]),
    ("token_id_negative", G(token_ids=[1, -1]), INVALID,
     ["token_ids", "[0, 320)"]),
    ("token_id_vocab_size", G(token_ids=[1, 320]), INVALID,
     ["token_ids", "[0, 320)"]),
    # Generate: sampling.
    ("max_new_tokens_0", G(prompt="hi", max_new_tokens=0), INVALID,
     ["sampling.max_new_tokens"]),
    ("max_new_tokens_beyond_max_seq_len", G(prompt="hi", max_new_tokens=300),
     INVALID, ["sampling.max_new_tokens", "max_seq_len"]),
    ("max_new_tokens_beyond_max_seq_len_with_prompt",
     G(token_ids=[5] * 200, max_new_tokens=57), INVALID,
     ["sampling.max_new_tokens", "56"]),
    ("max_new_tokens_negative", G(prompt="hi", max_new_tokens=-3), INVALID,
     ["sampling.max_new_tokens"]),
    ("top_p_0", G(prompt="hi", top_p=0.0), INVALID, ["sampling.top_p"]),
    ("top_p_1.5", G(prompt="hi", top_p=1.5), INVALID, ["sampling.top_p"]),
    ("temperature_negative", G(prompt="hi", temperature=-1.0), INVALID,
     ["sampling.temperature"]),
    ("temperature_nan", G(prompt="hi", temperature=NAN), INVALID,
     ["sampling.temperature"]),
    ("temperature_inf", G(prompt="hi", temperature=float("inf")), INVALID,
     ["sampling.temperature"]),
    ("top_k_negative", G(prompt="hi", top_k=-1), INVALID, ["sampling.top_k"]),
    ("repetition_penalty_0", G(prompt="hi", repetition_penalty=0.0), INVALID,
     ["sampling.repetition_penalty"]),
    ("repetition_penalty_nan", G(prompt="hi", repetition_penalty=NAN),
     INVALID, ["sampling.repetition_penalty"]),
    ("stop_17_strings", G(prompt="hi", stop=["s%d" % i for i in range(17)]),
     INVALID, ["sampling.stop", "16"]),
    ("stop_empty_string", G(prompt="hi", stop=["ok", ""]), INVALID,
     ["sampling.stop[1]"]),
    ("stop_string_too_long", G(prompt="hi", stop=["x" * 10000]), INVALID,
     ["sampling.stop[0]"]),
    # Generate: activation.
    ("ratio_negative", G(prompt="hi", ratio=-0.1), INVALID,
     ["activation.ratio", "(0, 1]"]),
    ("ratio_above_1", G(prompt="hi", ratio=1.5), INVALID,
     ["activation.ratio", "(0, 1]"]),
    ("ratio_nan", G(prompt="hi", ratio=NAN), INVALID, ["activation.ratio"]),
    ("min_ratio_above_ratio", G(prompt="hi", ratio=0.5, min_ratio=0.75),
     INVALID, ["activation.min_ratio"]),
    ("min_ratio_negative", G(prompt="hi", min_ratio=-0.25), INVALID,
     ["activation.min_ratio"]),
    ("min_ratio_nan", G(prompt="hi", ratio=0.5, min_ratio=NAN), INVALID,
     ["activation.min_ratio"]),
    # Generate: the model.
    ("generate_unknown_model", G(prompt="hi", model="no-such-model"),
     grpc.StatusCode.NOT_FOUND, ["no-such-model", "demo-lm"]),
    ("generate_huge_model_name", G(prompt="hi", model="m" * 100000),
     grpc.StatusCode.NOT_FOUND, ["mmm... (100000 bytes)", "demo-lm"]),
    ("generate_on_vit", G(prompt="hi", model="demo-vit"), INVALID,
     ["model", "demo-vit"]),
    # Classify: images and pixels.
    ("image_corrupt", C(image=b"\x89PNG\r\n\x1a\n not really a png"), INVALID,
     ["image"]),
    ("image_garbage", C(image=b"hello world"), INVALID, ["image"]),
    ("image_gif", C(image=GIF_1X1), INVALID, ["image", "PNG or JPEG"]),
    ("image_bmp", C(image=BMP_1X1), INVALID, ["image", "PNG or JPEG"]),
    ("image_truncated_png", "truncated_png", INVALID, ["image"]),
    ("image_truncated_jpeg", "truncated_jpeg", INVALID,
     ["image", "Premature end of JPEG file"]),
    ("pixels_wrong_shape", C(pixels=dict(shape=[3, 8, 8], data=[0.5] * 192)),
     INVALID, ["pixels.shape", "[3, 16, 16]"]),
    ("pixels_hwc_shape", C(pixels=dict(shape=[16, 16, 3], data=[0.5] * 768)),
     INVALID, ["pixels.shape"]),
    ("pixels_data_count_mismatch",
     C(pixels=dict(shape=[3, 16, 16], data=[0.5] * 700)), INVALID,
     ["pixels.data", "768"]),
    ("pixel_above_1", C(pixels=dict(shape=[3, 16, 16], data=[0.5] * 767 + [1.5])),
     INVALID, ["pixels.data", "[0, 1]"]),
    ("pixel_negative", C(pixels=dict(shape=[3, 16, 16], data=[-0.1] + [0.5] * 767)),
     INVALID, ["pixels.data", "[0, 1]"]),
    ("pixel_nan", C(pixels=dict(shape=[3, 16, 16], data=[NAN] + [0.5] * 767)),
     INVALID, ["pixels.data"]),
    # Classify: what goes with which model.
    ("classify_no_input_vit", C(), INVALID, ["image", "pixels", "text"]),
    ("classify_no_input_lm", C(model="demo-lm"), INVALID,
     ["image", "pixels", "text"]),
    ("classify_lm_without_labels", C(model="demo-lm", text="hello"), INVALID,
     ["labels"]),
    ("classify_lm_empty_label", C(model="demo-lm", text="hi", labels=["a", ""]),
     INVALID, ["labels[1]"]),
    ("classify_lm_label_too_long",
     C(model="demo-lm", text="hi", labels=["a", "b" * (64 * 1024 + 1)]),
     INVALID, ["labels[1]", "65536 bytes"]),
    ("classify_lm_too_many_labels",
     C(model="demo-lm", text="hi", labels=["l%d" % i for i in range(65)]),
     INVALID, ["labels", "64"]),
    ("classify_lm_pixels", C(model="demo-lm", pixels=PIXELS_OK), INVALID,
     ["pixels"]),
    ("classify_text_on_vit", C(text="hello", labels=["a", "b"]), INVALID,
     ["text"]),
    ("classify_labels_on_vit", C(pixels=PIXELS_OK, labels=["a"]), INVALID,
     ["labels"]),
    ("top_n_too_large_vit", C(pixels=PIXELS_OK, top_n=6), INVALID,
     ["top_n", "5"]),
    ("top_n_negative_vit", C(pixels=PIXELS_OK, top_n=-1), INVALID, ["top_n"]),
    ("top_n_too_large_lm", C(model="demo-lm", text="hi", labels=["a", "b"],
                             top_n=3), INVALID, ["top_n", "2"]),
    ("classify_ratio_above_1", C(pixels=PIXELS_OK, ratio=2.0), INVALID,
     ["activation.ratio"]),
    ("classify_unknown_model", C(model="no-such-model", pixels=PIXELS_OK),
     grpc.StatusCode.NOT_FOUND, ["no-such-model"]),
]


def _truncated_png():
    with open(os.path.join(lib.FIXTURES, "vit_learned", "golden.json")) as f:
        pixels = json.load(f)["pixels"][0]
    png = lib.encode_png(pixels)
    return ("Classify", dict(model="demo-vit", image=png[:len(png) // 2]))


def _truncated_jpeg():
    with open(os.path.join(lib.SOURCE_DIR, "tests", "testdata",
                           "quadrants_16x16_grey.jpg"), "rb") as f:
        jpeg = f.read()
    return ("Classify", dict(model="demo-vit", image=jpeg[:len(jpeg) // 2]))


def build(api, case):
    if case == "truncated_png":
        case = _truncated_png()
    if case == "truncated_jpeg":
        case = _truncated_jpeg()
    rpc, fields = case
    fields = dict(fields)
    if rpc == "Generate":
        return rpc, lib.generate_request(api.pb, **fields)
    ratio = fields.pop("ratio", None)
    pixels = fields.pop("pixels", None)
    request = api.pb.ClassifyRequest(**fields)
    if pixels is not None:
        request.pixels.shape.extend(pixels["shape"])
        request.pixels.data.extend(pixels["data"])
    if ratio is not None:
        request.activation.ratio = ratio
    return rpc, request


def call(stub, rpc, request):
    if rpc == "Generate":
        return lib.run_generate(stub, request)
    return stub.Classify(request, timeout=lib.RPC_TIMEOUT)


def check_still_serving(api, stub):
    messages = lib.run_generate(
        stub, lib.generate_request(api.pb, prompt="Once upon a time",
                                   max_new_tokens=3))
    assert messages[-1].finish_reason == api.pb.LENGTH
    assert messages[-1].usage.completion_tokens == 3
    _, request = build(api, C(pixels=PIXELS_OK, top_n=2))
    assert len(stub.Classify(request, timeout=lib.RPC_TIMEOUT).classes) == 2


def _values(case):
    return case.values if hasattr(case, "marks") else case


def test_at_least_25_cases():
    assert len(CASES) >= 25


@pytest.mark.parametrize("name,case,code,fragments", CASES,
                         ids=[_values(c)[0] for c in CASES])
def test_bad_input(api, stub, name, case, code, fragments):
    rpc, request = build(api, case)
    error = lib.rpc_error(call, stub, rpc, request)
    assert error.code() == code, (name, error.code(), error.details())
    for fragment in fragments:
        assert fragment in error.details(), (name, error.details())
    check_still_serving(api, stub)


def test_bad_requests_do_not_disturb_a_running_stream(api, stub):
    # A long greedy stream runs while bad requests arrive; it is unaffected.
    request = lib.generate_request(api.pb, prompt="Once upon a time",
                                   max_new_tokens=200)
    alone = lib.token_ids_of(lib.run_generate(stub, request))
    stream = stub.Generate(request, timeout=lib.RPC_TIMEOUT)
    first = next(stream)
    errors = []
    for _, case, code, _ in [c for c in CASES if not hasattr(c, "marks")][:20]:
        rpc, bad = build(api, case)
        errors.append(lib.rpc_error(call, stub, rpc, bad).code() == code)
    rest = list(stream)
    assert all(errors)
    assert list(first.token_ids) + lib.token_ids_of(rest) == alone
    assert rest[-1].usage.completion_tokens == len(alone)


def test_echoed_client_text_is_cut_short(api, stub):
    _, request = build(api, G(prompt="hi", model="\u00e9" * 50000))
    error = lib.rpc_error(call, stub, "Generate", request)
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert len(error.details()) < 400, len(error.details())
    assert "(100000 bytes)" in error.details()  # whole characters kept
