"""This project's CUDA paths that a run can switch off, as moh-generate's
flags and as moh-server's config (generation.cuda_paths, cuda_graphs): the
GPU benchmark's triage (bench/gpu_bench.py) and the soak on a GPU
(bench/soak.py) take the same names, also from $MOH_CUDA_PATHS_OFF."""
import os

# Newest first: the order in which the GPU benchmark's triage tries them.
CUDA_PATHS = ["skinny_linear", "varlen_prefill", "fused_ops", "paged_decode",
              "graphs"]


def paths_off(text=None):
    """The names in a comma-separated list, $MOH_CUDA_PATHS_OFF's when
    `text` is None (ValueError naming any unknown)."""
    if text is None:
        text = os.environ.get("MOH_CUDA_PATHS_OFF", "")
    off = [p for p in text.split(",") if p]
    unknown = [p for p in off if p not in CUDA_PATHS]
    if unknown:
        raise ValueError("%s not among %s" % (",".join(unknown),
                                              ",".join(CUDA_PATHS)))
    return off


def path_flags(off):
    """moh-generate's flags leaving the paths `off` off."""
    return ["--cuda_graphs=0" if p == "graphs" else "--cuda_%s=false" % p
            for p in off]


def path_config(off):
    """The server's generation fields leaving the paths `off` off (text
    format, each after a space)."""
    fields = ["%s: false" % p for p in off if p != "graphs"]
    return ((" cuda_paths { %s }" % " ".join(fields) if fields else "") +
            (" cuda_graphs: 0" if "graphs" in off else ""))
