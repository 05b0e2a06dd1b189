"""Writes test images and Pillow's preprocessing of them for image_decoder_test.

Usage: /usr/bin/python3 tests/reference/make_image_fixtures.py OUTDIR

The released MoH-ViT classifiers were evaluated with torchvision on PIL images:
Image.open(f).convert(mode), Resize(S, interpolation=BICUBIC), CenterCrop(C),
ToTensor. For each image and each case below this writes what that pipeline
gives before ToTensor's division by 255, as raw uint8 HWC bytes, so the C++
test can require exact equality:

  OUTDIR/<image>                     the encoded image
  OUTDIR/<image>.s<S>_c<C>[_bilinear].<mode>
                                     Pillow's pixels: `mode` is RGB or L; S = 0
                                     is a plain resize to C x C (no crop);
                                     _bilinear: BILINEAR instead of BICUBIC
  OUTDIR/<image>.decoded.RGB         (JPEG only) Pillow's decoded pixels, so a
                                     decode and a resize can be told apart

The geometry follows torchvision 0.15.2's transforms/functional.py:
_compute_resized_output_size (the shorter side becomes S, the longer
int(S * long / short)) and center_crop (top = int(round((h - C) / 2.0)), with
Python's round-half-to-even). Deterministic (pixel values come from formulas)
and fast (well under a second); rewrites OUTDIR's files each run.
"""
import os
import sys

from PIL import Image

# (shorter side, crop, mode, filter)
CASES = [(256, 224, "RGB", "bicubic"), (73, 64, "RGB", "bicubic"),
         (73, 64, "L", "bicubic"), (0, 48, "RGB", "bicubic"),
         (48, 48, "RGB", "bicubic"), (73, 64, "RGB", "bilinear")]
FILTERS = {"bicubic": Image.BICUBIC, "bilinear": Image.BILINEAR}


def _value(x, y, c):
    """Sharp edges (bicubic overshoots and clips there), gradients and noise."""
    h = (x * 73856093) ^ (y * 19349663) ^ (c * 83492791)
    noise = (h ^ (h >> 13)) & 0x3F
    if (x // 9 + y // 7) % 3 == 0:
        return 255 - noise if c != 1 else noise
    return (x * (3 + c) + y * (5 - c) + noise) % 256


def _image(mode, width, height):
    bands = len(Image.new(mode, (1, 1)).getbands())
    data = bytearray()
    for y in range(height):
        for x in range(width):
            for c in range(bands):
                data.append(_value(x, y, c) if c < 3 else (x + 2 * y) % 256)
    return Image.frombytes(mode, (width, height), bytes(data))


def _palette_image(width, height):
    im = Image.new("P", (width, height))
    im.putpalette([_value(i, i // 3, c) for i in range(256) for c in range(3)])
    im.putdata([(x * 7 + y * 11) % 256 for y in range(height)
                for x in range(width)])
    im.info["transparency"] = 5  # written as tRNS; convert('RGB') ignores it
    return im


def images():
    """name -> (PIL image, save options)"""
    return {
        "rgb_300x200.png": (_image("RGB", 300, 200), {}),
        "grey_150x401.png": (_image("L", 150, 401), {}),
        "rgba_257x257.png": (_image("RGBA", 257, 257), {}),
        "palette_31x47.png": (_palette_image(31, 47), {"transparency": 5}),
        "photo_320x240.jpg": (_image("RGB", 320, 240), {"quality": 90}),
        "grey_progressive_97x130.jpg": (
            _image("L", 97, 130), {"quality": 85, "progressive": True}),
    }


def resized_size(width, height, shorter):
    """torchvision's _compute_resized_output_size for one int size."""
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = shorter, int(shorter * long / short)
    return (new_short, new_long) if width <= height else (new_long, new_short)


def center_crop(im, crop):
    """torchvision's center_crop when the crop fits."""
    width, height = im.size
    top = int(round((height - crop) / 2.0))
    left = int(round((width - crop) / 2.0))
    return im.crop((left, top, left + crop, top + crop))


def preprocess(path, shorter, crop, mode, resample):
    im = Image.open(path).convert(mode)
    if shorter == 0:
        size = (crop, crop)
    else:
        size = resized_size(im.size[0], im.size[1], shorter)
    if size != im.size:  # torchvision's resize returns the image itself then
        im = im.resize(size, resample)
    return center_crop(im, crop).tobytes()


def _write(path, data):
    tmp = "%s.tmp.%d" % (path, os.getpid())
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def main(argv):
    if len(argv) != 1 or argv[0].startswith("-"):
        print("usage: make_image_fixtures.py OUTDIR", file=sys.stderr)
        return 2
    outdir = os.path.abspath(argv[0])
    os.makedirs(outdir, exist_ok=True)
    for name, (im, options) in images().items():
        path = os.path.join(outdir, name)
        tmp = "%s.tmp.%d%s" % (path, os.getpid(), os.path.splitext(name)[1])
        im.save(tmp, **options)
        os.replace(tmp, path)
        for shorter, crop, mode, filter in CASES:
            suffix = "" if filter == "bicubic" else "_" + filter
            _write("%s.s%d_c%d%s.%s" % (path, shorter, crop, suffix, mode),
                   preprocess(path, shorter, crop, mode, FILTERS[filter]))
        if name.endswith(".jpg"):
            _write(path + ".decoded.RGB",
                   Image.open(path).convert("RGB").tobytes())
    print("make_image_fixtures: wrote %s (Pillow %s)"
          % (outdir, Image.__version__))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
