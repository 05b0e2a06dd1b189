# syntax=docker/dockerfile:1
# moh-serve container image: moh-server + moh-client + the demo models.
#
#   docker build -t moh-serve:cpu .                                   # CPU (Debian LibTorch 1.13)
#   docker build -t moh-serve:cuda --build-arg TORCH_VARIANT=cuda .   # CUDA (PyPI torch wheel's LibTorch)
#   docker run --rm -p 50051:50051 -p 9464:9464 -p 8000:8000 moh-serve:cpu  # serves the demo models
#
# Without a Docker daemon or registry: scripts/build_images.sh [--cpu] [--cuda]
# builds the same file with buildah on a debootstrapped Debian 12 base
# (--build-arg DEBIAN_IMAGE=localhost/debian:bookworm) and tags
# localhost/moh-serve:cpu and localhost/moh-serve:cuda.
#
# Needs BuildKit (the default builder since Docker 23) or buildah: only the
# stages of the chosen TORCH_VARIANT are built, and the RUN cache mounts keep
# apt's downloads, pip's wheels and ccache's objects between builds (a rebuild
# after a source change recompiles from ccache).
#
# CPU variant: the build stage installs the Debian 12 packages with the same
# script the README uses (scripts/install_deps.sh) and builds with
# scripts/build.sh; the runtime stage installs only the shared libraries
# (install_deps.sh --runtime).
#
# CUDA variant (TORCH_VARIANT=cuda): the LibTorch CI's CUDA build uses, the
# PyPI torch wheel pinned in scripts/torch_wheel.env (CUDA 13), installed by
# `install_deps.sh --torch=wheel` into its virtual environment
# ($MOH_TORCH_VENV, /opt/moh-serve/venv-torch-<version>) and built with
# `build.sh --torch=wheel` (build-cuda/). Still Debian 12, because moh-server
# links Debian 12's gRPC, Protobuf and Abseil (the nvidia/cuda images are
# Ubuntu/UBI and have other versions of those). The CUDA toolkit CMake's Torch
# config needs (nvcc, CUDA headers) comes from PyPI too: the `cuda-toolkit`
# wheels of the version the torch wheel pins, installed into the same venv;
# /usr/local/cuda (build.sh's default CUDA_HOME) links to their
# site-packages/nvidia/cu13 tree. The runtime stage has no Debian LibTorch
# (install_deps.sh --runtime-no-torch) and carries only the wheel's shared
# libraries (torch/lib, nvidia/*/lib; not the Python parts, not Triton) at the
# absolute paths the binaries' RUNPATH names; the GPU driver comes from the
# host through the NVIDIA container toolkit (NVIDIA_VISIBLE_DEVICES /
# NVIDIA_DRIVER_CAPABILITIES below), and must support CUDA 13.

ARG TORCH_VARIANT=cpu
ARG DEBIAN_IMAGE=debian:bookworm

# ---- build dependencies: exactly the README's install script ----
FROM ${DEBIAN_IMAGE} AS deps
WORKDIR /src
COPY scripts/install_deps.sh scripts/install_xgrammar.sh scripts/xgrammar.env \
     scripts/fetch_verified.sh scripts/
# apt's lists and .debs live in cache mounts, not in the layer (the Debian
# image's docker-clean hook would delete the .debs after each install).
# install_xgrammar.sh downloads xgrammar's sdist with curl: behind a
# TLS-intercepting proxy it trusts the build secret moh-ca (the host's CA
# bundle; see the CUDA stage below).
RUN --mount=type=cache,id=moh-apt-lists,target=/var/lib/apt/lists \
    --mount=type=cache,id=moh-apt-archives,target=/var/cache/apt/archives \
    --mount=type=secret,id=moh-ca,target=/run/secrets/moh-ca \
    rm -f /etc/apt/apt.conf.d/docker-clean \
 && if [ -s /run/secrets/moh-ca ]; then export CURL_CA_BUNDLE=/run/secrets/moh-ca; fi \
 && bash scripts/install_deps.sh

FROM deps AS torch-cpu
ENV MOH_TORCH=debian

FROM deps AS torch-cuda
COPY scripts/torch_wheel.env scripts/peer_requirements.txt scripts/
# 1. The torch wheel's venv (install_deps.sh --torch=wheel). 2. The CUDA
# toolkit wheels of the version the torch wheel pins (its `cuda-toolkit`
# requirement): nvcc, its headers and NVVM, into the same venv. 3. A CUDA_HOME
# in the layout CMake's FindCUDAToolkit and nvcc's nvcc.profile expect (lib64,
# targets/x86_64-linux, unversioned .so names) over site-packages/nvidia/cu13,
# linked from /usr/local/cuda. 4. /opt/moh-runtime-root: hard links to the
# shared libraries the runtime stage carries, under their absolute paths.
# Behind a TLS-intercepting proxy pip needs the proxy's CA: pass a CA bundle
# as the build secret moh-ca (build_images.sh passes the host's):
#   docker build --secret id=moh-ca,src=/etc/ssl/certs/ca-certificates.crt ...
RUN --mount=type=cache,id=moh-apt-lists,target=/var/lib/apt/lists \
    --mount=type=cache,id=moh-apt-archives,target=/var/cache/apt/archives \
    --mount=type=cache,id=moh-pip,target=/root/.cache/pip \
    --mount=type=secret,id=moh-ca,target=/run/secrets/moh-ca \
    set -eu \
 && if [ -s /run/secrets/moh-ca ]; then export PIP_CERT=/run/secrets/moh-ca; fi \
 && bash scripts/install_deps.sh --torch=wheel \
 && . scripts/torch_wheel.env \
 && py="$MOH_TORCH_VENV/bin/python" \
 && toolkit="$("$py" -c 'import importlib.metadata as m; print(m.version("cuda-toolkit"))')" \
 && "$MOH_TORCH_VENV/bin/pip" install -q --disable-pip-version-check \
      "cuda-toolkit[nvcc,crt,cccl,nvvm,culibos,profiler]==$toolkit" \
 && site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
 && cuda="$site/nvidia/cu13" \
 && test -x "$cuda/bin/nvcc" \
 && ln -sfn lib "$cuda/lib64" \
 && mkdir -p "$cuda/targets/x86_64-linux" \
 && ln -sfn ../../include "$cuda/targets/x86_64-linux/include" \
 && ln -sfn ../../lib "$cuda/targets/x86_64-linux/lib" \
 && for f in "$cuda"/lib/lib*.so.*; do \
      n="${f##*/}"; n="${n%%.so.*}.so"; \
      [ -e "$cuda/lib/$n" ] || ln -s "${f##*/}" "$cuda/lib/$n"; \
    done \
 && ln -sfn "$cuda" /usr/local/cuda \
 && "$cuda/bin/nvcc" --version \
 && stage() { mkdir -p "/opt/moh-runtime-root${1%/*}" && cp -al "$1" "/opt/moh-runtime-root$1"; } \
 && stage "$site/torch/lib" \
 && for d in "$site"/nvidia/*/lib; do stage "$d"; done \
 && rm -f "/opt/moh-runtime-root$site/torch/lib/libtorch_python.so" \
          "/opt/moh-runtime-root$site"/nvidia/*/lib/*.a \
 && mkdir -p /opt/moh-runtime-root/usr/local \
 && ln -sfn "$cuda" /opt/moh-runtime-root/usr/local/cuda
ENV MOH_TORCH=wheel

# ---- build: the README's build script, two targets ----
FROM torch-${TORCH_VARIANT} AS build
WORKDIR /src
COPY . .
# Debian's LibTorch builds into build/, the wheel's into build-cuda/. The
# build tree is dropped in the same step (ccache keeps the objects).
RUN --mount=type=cache,id=moh-ccache,target=/root/.cache/ccache \
    export CCACHE_DIR=/root/.cache/ccache \
 && bash scripts/build.sh --torch="$MOH_TORCH" moh-server moh-client \
 && dir=build && if [ "$MOH_TORCH" = wheel ]; then dir=build-cuda; fi \
 && install -D -m 0755 -t /opt/moh/bin "$dir/service/moh-server" "$dir/client/moh-client" \
 && rm -rf build build-cuda
# The demo models: the repository's models/ directory (demo-lm, demo-vit,
# demo-dit).
RUN cp -a models /opt/moh/models

# ---- runtime: shared libraries only ----
FROM ${DEBIAN_IMAGE} AS runtime-cpu
COPY scripts/install_deps.sh /tmp/install_deps.sh
RUN --mount=type=cache,id=moh-apt-lists,target=/var/lib/apt/lists \
    --mount=type=cache,id=moh-apt-archives,target=/var/cache/apt/archives \
    rm -f /etc/apt/apt.conf.d/docker-clean \
 && bash /tmp/install_deps.sh --runtime \
 && rm -f /tmp/install_deps.sh

FROM ${DEBIAN_IMAGE} AS runtime-cuda
COPY scripts/install_deps.sh /tmp/install_deps.sh
RUN --mount=type=cache,id=moh-apt-lists,target=/var/lib/apt/lists \
    --mount=type=cache,id=moh-apt-archives,target=/var/cache/apt/archives \
    rm -f /etc/apt/apt.conf.d/docker-clean \
 && bash /tmp/install_deps.sh --runtime-no-torch \
 && rm -f /tmp/install_deps.sh
# The wheel's torch/lib and nvidia/*/lib at the build's absolute paths (the
# binaries' RUNPATH names torch/lib and /usr/local/cuda/lib), and the
# /usr/local/cuda link.
COPY --from=torch-cuda /opt/moh-runtime-root/ /
ENV NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

FROM runtime-${TORCH_VARIANT} AS runtime
RUN groupadd --system --gid 10001 moh \
 && useradd --system --uid 10001 --gid moh --home-dir /opt/moh --no-create-home \
      --shell /usr/sbin/nologin moh
COPY --from=build /opt/moh/bin/ /opt/moh/bin/
COPY --from=build --chown=root:root /opt/moh/models /opt/moh/models
ENV PATH=/opt/moh/bin:${PATH}
USER 10001:10001
WORKDIR /opt/moh
# gRPC (Inference, grpc.health.v1.Health, reflection) and Prometheus /metrics.
EXPOSE 50051 9464 8000
# Healthy once every model is loaded and warmed up; unhealthy while draining.
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
  CMD ["/opt/moh/bin/moh-client", "health", "--server=localhost:50051"]
# SIGTERM drains: NOT_SERVING, in-flight requests finish (--drain_timeout,
# default 30 s), exit 0. Give `docker stop` more than that: docker stop -t 45.
STOPSIGNAL SIGTERM
ENTRYPOINT ["/opt/moh/bin/moh-server"]
CMD ["--demo_dir=/opt/moh/models"]
