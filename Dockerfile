# syntax=docker/dockerfile:1
# moh-serve container image: moh-server + moh-client + the demo models.
#
#   docker build -t moh-serve:cpu .                                   # CPU (Debian LibTorch 1.13)
#   docker build -t moh-serve:cuda --build-arg TORCH_VARIANT=cuda .   # CUDA LibTorch
#   docker run --rm -p 50051:50051 -p 9464:9464 moh-serve:cpu         # serves the demo models
#
# Needs BuildKit (the default builder since Docker 23): only the stages of the
# chosen TORCH_VARIANT are built.
#
# CPU variant: the build stage installs the Debian 12 packages with the same
# script the README uses (scripts/install_deps.sh) and builds with
# scripts/build.sh; the runtime stage installs only the shared libraries
# (install_deps.sh --runtime).
#
# CUDA variant (TORCH_VARIANT=cuda): still Debian 12, because moh-server links
# Debian 12's gRPC, Protobuf and Abseil (the nvidia/cuda images are Ubuntu/UBI
# and have other versions of those). The build stage adds the CUDA toolkit from
# NVIDIA's Debian 12 apt repository (CMake's Torch config looks for it) and
# unpacks the CUDA LibTorch zip (LIBTORCH_URL, cxx11 ABI, "shared-with-deps":
# it bundles cudart, cuBLAS, cuDNN, NCCL) at /opt/libtorch; CMake gets
# -DTorch_DIR=/opt/libtorch/share/cmake/Torch. The runtime stage has no Debian
# LibTorch (install_deps.sh --runtime-no-torch) and carries /opt/libtorch/lib
# instead; the GPU driver comes from the host through the NVIDIA container
# toolkit (NVIDIA_VISIBLE_DEVICES / NVIDIA_DRIVER_CAPABILITIES below). Keep
# CUDA_VERSION and LIBTORCH_URL's "+cuXYZ" in step, and the driver recent
# enough for that CUDA version.

ARG TORCH_VARIANT=cpu
ARG DEBIAN_IMAGE=debian:bookworm
ARG CUDA_VERSION=12.4
ARG LIBTORCH_URL=https://download.pytorch.org/libtorch/cu124/libtorch-cxx11-abi-shared-with-deps-2.5.1%2Bcu124.zip

# ---- build dependencies: exactly the README's install script ----
FROM ${DEBIAN_IMAGE} AS deps
WORKDIR /src
COPY scripts/install_deps.sh scripts/install_deps.sh
RUN bash scripts/install_deps.sh && rm -rf /var/lib/apt/lists/*

FROM deps AS torch-cpu
ENV MOH_CMAKE_ARGS=""

FROM deps AS torch-cuda
ARG CUDA_VERSION
ARG LIBTORCH_URL
# Some LibTorch zips carry their own protobuf headers: moh-server's generated
# code must see Debian's (it links Debian's libprotobuf), so they are removed.
RUN set -eux; \
    apt-get update -q; \
    apt-get install -y -q --no-install-recommends ca-certificates unzip; \
    curl -fsSL -o /tmp/cuda-keyring.deb \
      https://developer.download.nvidia.com/compute/cuda/repos/debian12/x86_64/cuda-keyring_1.1-1_all.deb; \
    dpkg -i /tmp/cuda-keyring.deb; rm /tmp/cuda-keyring.deb; \
    apt-get update -q; \
    apt-get install -y -q --no-install-recommends "cuda-toolkit-$(echo "${CUDA_VERSION}" | tr . -)"; \
    rm -rf /var/lib/apt/lists/*; \
    curl -fsSL -o /tmp/libtorch.zip "${LIBTORCH_URL}"; \
    unzip -q /tmp/libtorch.zip -d /opt; rm /tmp/libtorch.zip; \
    test -f /opt/libtorch/share/cmake/Torch/TorchConfig.cmake; \
    rm -rf /opt/libtorch/include/google
ENV PATH=/usr/local/cuda/bin:${PATH} \
    CUDACXX=/usr/local/cuda/bin/nvcc \
    MOH_CMAKE_ARGS="-DTorch_DIR=/opt/libtorch/share/cmake/Torch -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc"

# ---- build: the README's build script, two targets ----
FROM torch-${TORCH_VARIANT} AS build
WORKDIR /src
COPY . .
# build.sh configures build/ only when it is not configured yet: configure it
# first to pass the LibTorch location and skip tests and benchmarks.
RUN --mount=type=cache,target=/root/.cache/ccache \
    cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
          -DMOH_BUILD_TESTS=OFF -DMOH_BUILD_BENCH=OFF ${MOH_CMAKE_ARGS} \
 && bash scripts/build.sh moh-server moh-client
# The demo models: the repository's models/ directory (demo-lm, demo-vit).
RUN mkdir -p /opt/moh && cp -a models /opt/moh/models

# ---- runtime: shared libraries only ----
FROM ${DEBIAN_IMAGE} AS runtime-cpu
COPY scripts/install_deps.sh /tmp/install_deps.sh
RUN bash /tmp/install_deps.sh --runtime && rm -rf /var/lib/apt/lists/* /tmp/install_deps.sh

FROM ${DEBIAN_IMAGE} AS runtime-cuda
COPY scripts/install_deps.sh /tmp/install_deps.sh
RUN bash /tmp/install_deps.sh --runtime-no-torch && rm -rf /var/lib/apt/lists/* /tmp/install_deps.sh
COPY --from=torch-cuda /opt/libtorch/lib /opt/libtorch/lib
ENV LD_LIBRARY_PATH=/opt/libtorch/lib \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

FROM runtime-${TORCH_VARIANT} AS runtime
RUN groupadd --system --gid 10001 moh \
 && useradd --system --uid 10001 --gid moh --home-dir /opt/moh --no-create-home \
      --shell /usr/sbin/nologin moh
COPY --from=build /src/build/service/moh-server /src/build/client/moh-client /opt/moh/bin/
COPY --from=build --chown=root:root /opt/moh/models /opt/moh/models
ENV PATH=/opt/moh/bin:${PATH}
USER 10001:10001
WORKDIR /opt/moh
# gRPC (Inference, grpc.health.v1.Health, reflection) and Prometheus /metrics.
EXPOSE 50051 9464
# Healthy once every model is loaded and warmed up; unhealthy while draining.
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
  CMD ["/opt/moh/bin/moh-client", "health", "--server=localhost:50051"]
# SIGTERM drains: NOT_SERVING, in-flight requests finish (--drain_timeout,
# default 30 s), exit 0. Give `docker stop` more than that: docker stop -t 45.
STOPSIGNAL SIGTERM
ENTRYPOINT ["/opt/moh/bin/moh-server"]
CMD ["--demo_dir=/opt/moh/models"]
