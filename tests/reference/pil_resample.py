"""PIL's BICUBIC resize of 8-bit images, transcribed in numpy: the exact arithmetic a
C++ implementation must follow to give the same bytes as Image.resize(size, BICUBIC).

The preprocessing of MoH-ViT (datasets.py build_transform) resizes a PIL image, so the
reference (moh_transnext.preprocess_image) calls PIL itself; this file states what PIL
does, and `--self-test` proves that it is byte-identical to the installed PIL.

Pillow src/libImaging/Resample.c (unchanged in this respect from Pillow 4.3 to 11):
  bicubic filter, a = -0.5, support 2:
    |x| < 1: ((a + 2)|x| - (a + 3))|x|^2 + 1;  1 <= |x| < 2: (((|x| - 5)|x| + 8)|x| - 4) a
  precompute_coeffs(in_size, out_size), in doubles:
    scale = in_size / out_size; filterscale = max(scale, 1); support = 2 * filterscale
    (antialiasing: the filter is stretched when downscaling)
    for each output index xx: center = (xx + 0.5) * scale
      xmin = max((int)(center - support + 0.5), 0)          (C cast: truncation)
      xmax = min((int)(center + support + 0.5), in_size)
      w[x] = filter((x + xmin - center + 0.5) / filterscale) for x in [0, xmax - xmin)
             (computed as * (1.0 / filterscale)), then w[x] /= sum(w) (summed in order)
  8-bit coefficients: k = (int)(w * 2^22 + 0.5) for w >= 0, (int)(w * 2^22 - 0.5) for w < 0
  one pass: out = clamp((2^21 + sum_x in[xmin + x] * k[x]) >> 22, 0, 255) in 32-bit int
  (>> of a negative sum floors; the clamp is Pillow's clip8 table), per channel.
  Order: the horizontal pass first (only when the width changes), to uint8, then the
  vertical pass (only when the height changes) on that uint8 result.
"""
import sys

import numpy as np

PRECISION_BITS = 32 - 8 - 2


def _bicubic(x):
    a = -0.5
    if x < 0.0:
        x = -x
    if x < 1.0:
        return ((a + 2.0) * x - (a + 3.0)) * x * x + 1
    if x < 2.0:
        return (((x - 5) * x + 8) * x - 4) * a
    return 0.0


def coefficients(in_size, out_size):
    """[(xmin, [int coefficient per source pixel from xmin])] per output index."""
    scale = float(in_size) / out_size
    filterscale = max(scale, 1.0)
    support = 2.0 * filterscale
    ss = 1.0 / filterscale
    out = []
    for xx in range(out_size):
        center = 0.0 + (xx + 0.5) * scale
        xmin = max(int(center - support + 0.5), 0)
        xmax = min(int(center + support + 0.5), in_size) - xmin
        w = [_bicubic((x + xmin - center + 0.5) * ss) for x in range(xmax)]
        ww = 0.0
        for v in w:
            ww += v
        if ww != 0.0:
            w = [v / ww for v in w]
        k = [int(-0.5 + v * (1 << PRECISION_BITS)) if v < 0 else int(0.5 + v * (1 << PRECISION_BITS)) for v in w]
        out.append((xmin, np.array(k, dtype=np.int64)))
    return out


def _pass(img, out_size, axis):
    """One 8-bit pass along axis (0 = rows / height, 1 = columns / width) of [H, W, C] uint8."""
    src = np.moveaxis(img.astype(np.int64), axis, 0)
    out = np.empty((out_size,) + src.shape[1:], dtype=np.uint8)
    for i, (xmin, k) in enumerate(coefficients(src.shape[0], out_size)):
        acc = (1 << (PRECISION_BITS - 1)) + np.tensordot(k, src[xmin:xmin + len(k)], axes=(0, 0))
        out[i] = np.clip(acc >> PRECISION_BITS, 0, 255)
    return np.moveaxis(out, 0, axis)


def resize_bicubic(img, width, height):
    """uint8 [H, W, C] -> uint8 [height, width, C], as PIL Image.resize((width, height), BICUBIC)."""
    if img.shape[1] != width:
        img = _pass(img, width, 1)
    if img.shape[0] != height:
        img = _pass(img, height, 0)
    return img


def self_test(verbose=True):
    import PIL
    from PIL import Image

    rng = np.random.default_rng(5)
    cases = [((200, 300), (256, 384)), ((401, 150), (684, 256)), ((240, 320), (73, 97)), ((48, 64), (73, 97)),
             ((257, 257), (256, 256)), ((256, 300), (256, 300)), ((100, 37), (100, 250)), ((31, 500), (7, 3))]
    for (h, w), (oh, ow) in cases:
        smooth = np.stack(np.meshgrid(np.arange(w), np.arange(h)), -1).sum(-1)[..., None] % 256
        img = np.concatenate([rng.integers(0, 256, (h, w, 2)), smooth], axis=-1).astype(np.uint8)
        img[: h // 3, : w // 3] = 255 * (np.indices((h // 3, w // 3)).sum(0) % 2)[..., None]
        want = np.asarray(Image.fromarray(img, "RGB").resize((ow, oh), Image.BICUBIC))
        got = resize_bicubic(img, ow, oh)
        assert got.shape == want.shape and np.array_equal(got, want), ((h, w), (oh, ow))
    if verbose:
        print("pil_resample self-test: OK (%d sizes, byte-identical to Pillow %s)" % (len(cases), PIL.__version__))


if __name__ == "__main__":
    if sys.argv[1:] != ["--self-test"]:
        print("usage: pil_resample.py --self-test", file=sys.stderr)
        sys.exit(2)
    self_test()
