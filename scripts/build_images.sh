#!/usr/bin/env bash
# Builds the moh-serve container images from the repository's Dockerfile with
# buildah: no container daemon, no registry. Must run as root (buildah's
# chroot isolation; Debian packages).
#   scripts/build_images.sh [--cpu] [--cuda]   (default: both)
# --cpu   localhost/moh-serve:cpu   (Debian's LibTorch 1.13; 1.1 GB)
# --cuda  localhost/moh-serve:cuda  (the PyPI torch wheel of torch_wheel.env,
#         CUDA 13; 4.2 GB; not run by CI)
#
# 1. Installs buildah and debootstrap from Debian if missing.
# 2. The base image: the Dockerfile's debian:bookworm is made locally with
#    `debootstrap --variant=minbase bookworm` from the Debian mirror apt uses
#    here (or $MOH_DEBIAN_MIRROR) and kept in buildah's storage as
#    $MOH_BASE_IMAGE (localhost/debian:bookworm); later runs reuse it
#    (`buildah rmi localhost/debian:bookworm` to refresh it).
# 3. `buildah bud --layers` with --build-arg DEBIAN_IMAGE=<that image>: the
#    layer cache skips unchanged steps, and the Dockerfile's RUN cache mounts
#    (buildah keeps them in /var/tmp/buildah-cache) keep apt's downloads,
#    pip's wheels and ccache's objects, so a source change recompiles from
#    ccache (seconds). The build stage is tagged too
#    (localhost/moh-serve-build:VARIANT) so that its layers stay cached, and
#    layers no tagged image uses any more are removed after each build.
#    The host's CA bundle ($PIP_CERT, $SSL_CERT_FILE or Debian's) is the
#    build secret moh-ca, for pip behind a TLS-intercepting proxy.
# Storage: buildah's default (/var/lib/containers/storage, overlay; about
# 3.5 GB for the CPU image and its cache, 10 GB more for the CUDA one); when
# overlay does not work there (e.g. inside a container), the vfs driver
# (which copies every layer: much more disk).
# Prints each step's duration; every line of buildah's output carries the
# seconds since that build started. Only the steps, cache hits and compiler
# progress are shown (MOH_IMAGE_VERBOSE=1: everything); the full logs go to
# $MOH_IMAGE_LOG_DIR (/tmp/moh-build-images).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/torch_wheel.env
. scripts/torch_wheel.env

BASE_IMAGE="${MOH_BASE_IMAGE:-localhost/debian:bookworm}"
SUITE=bookworm
ISOLATION=chroot
LOG_DIR="${MOH_IMAGE_LOG_DIR:-/tmp/moh-build-images}"
# What of buildah's output is shown (everything goes to the log);
# MOH_IMAGE_VERBOSE=1 shows everything.
SHOW='STEP [0-9]|^\[ *[0-9]+s\] (-->|COMMIT|Successfully|Using cache|\[[0-9]+/[0-9]+\] |install_deps:|.*([Ee]rror:|ERROR|[Ww]arning:|WARN|FAILED))'
if [ "${MOH_IMAGE_VERBOSE:-0}" = 1 ]; then SHOW=''; fi

cpu=0 cuda=0
for arg in "$@"; do
  case "$arg" in
    --cpu) cpu=1 ;;
    --cuda) cuda=1 ;;
    *)
      echo "usage: $0 [--cpu] [--cuda]" >&2
      exit 2
      ;;
  esac
done
if [ "$cpu" = 0 ] && [ "$cuda" = 0 ]; then cpu=1 cuda=1; fi
if [ "$(id -u)" -ne 0 ]; then
  echo "build_images: must run as root (buildah --isolation chroot, apt, debootstrap)" >&2
  exit 1
fi
mkdir -p "$LOG_DIR"

say() { echo "build_images: $*"; }
timings=()
step_start() { step_name="$1"; step_t0=$SECONDS; say "== $1"; }
step_end() {
  local took=$((SECONDS - step_t0))
  timings+=("$(printf '%-36s %5d s' "$step_name" "$took")")
  say "== $step_name: done in ${took} s"
}

# ---- 1. tools ----
step_start "tools (buildah, debootstrap)"
# shellcheck source=scripts/install_deps.sh
. scripts/install_deps.sh  # defines install_missing, installs nothing
install_missing build_images buildah debootstrap debian-archive-keyring
# Overlay storage, unless it does not work here (overlay on overlay).
if [ -z "${STORAGE_DRIVER:-}" ] && ! buildah info >/dev/null 2>&1; then
  say "buildah's default storage does not work here; using the vfs driver"
  export STORAGE_DRIVER=vfs
fi
say "storage: $(buildah info --format '{{.store.GraphDriverName}} in {{.store.GraphRoot}}')"
step_end

# ---- 2. base image ----
# The mirror (and security mirror) apt uses here, as the image's sources.
apt_uri() {  # apt_uri SUITE DEFAULT
  local uri
  # shellcheck disable=SC2016  # apt's own $(...) fields
  uri="$(apt-get indextargets --format '$(REPO_URI) $(RELEASE)' 'Created-By: Packages' \
    2>/dev/null | awk -v s="$1" '$2 == s { print $1; exit }')"
  echo "${uri:-$2}"
}

base_ctr=""
cleanup_base() {
  if [ -n "$base_ctr" ]; then
    buildah umount "$base_ctr" >/dev/null 2>&1 || true
    buildah rm "$base_ctr" >/dev/null 2>&1 || true
  fi
}

step_start "base image $BASE_IMAGE"
if buildah inspect --type image "$BASE_IMAGE" >/dev/null 2>&1; then
  say "reusing $BASE_IMAGE (created $(buildah inspect --type image \
    --format '{{.Docker.Created}}' "$BASE_IMAGE"))"
else
  mirror="${MOH_DEBIAN_MIRROR:-$(apt_uri "$SUITE" http://deb.debian.org/debian/)}"
  security="$(apt_uri "$SUITE-security" http://deb.debian.org/debian-security/)"
  say "debootstrap --variant=minbase $SUITE from $mirror"
  trap cleanup_base EXIT
  base_ctr="$(buildah from --name "moh-debootstrap-$$" scratch)"
  root="$(buildah mount "$base_ctr")"
  debootstrap --variant=minbase "$SUITE" "$root" "$mirror" >/tmp/moh-debootstrap-$$.log 2>&1 || {
    tail -30 /tmp/moh-debootstrap-$$.log >&2
    say "debootstrap failed (log: /tmp/moh-debootstrap-$$.log)" >&2
    exit 1
  }
  rm -f /tmp/moh-debootstrap-$$.log
  # The apt sources of Debian's own image (deb822, with updates and security),
  # no package lists or caches, and no host files.
  rm -f "$root/etc/apt/sources.list"
  cat >"$root/etc/apt/sources.list.d/debian.sources" <<EOF
Types: deb
URIs: ${mirror%/}
Suites: $SUITE $SUITE-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: ${security%/}
Suites: $SUITE-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
  chroot "$root" apt-get clean
  rm -rf "$root"/var/lib/apt/lists/* "$root"/var/log/*.log "$root"/var/cache/debconf/*-old
  rm -f "$root/etc/resolv.conf" "$root/etc/hostname"
  buildah umount "$base_ctr" >/dev/null
  buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --cmd bash --label moh-serve.base="debootstrap --variant=minbase $SUITE $mirror" \
    "$base_ctr"
  buildah commit --quiet --rm "$base_ctr" "$BASE_IMAGE" >/dev/null
  base_ctr=""
  trap - EXIT
  say "created $BASE_IMAGE"
fi
step_end

# ---- 3. the images ----
# The CA bundle pip uses here, as the build secret moh-ca: the CUDA stage's
# pip and the deps stage's curl (xgrammar's sdist) then trust what this
# machine trusts (a TLS-intercepting proxy's CA).
secrets=()
ca="${PIP_CERT:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}"
if [ -s "$ca" ]; then secrets=(--secret "id=moh-ca,src=$ca"); fi

bud() {  # bud TAG LOG [buildah bud arguments...]
  local tag="$1" log="$2" t0=$SECONDS
  shift 2
  say "buildah bud $* -t $tag (full log: $log)"
  # Shown: buildah's steps, cache hits, install_deps' summary and ninja's
  # progress, each with the seconds since this build started.
  if ! buildah bud --isolation "$ISOLATION" --layers --force-rm --pull=never \
      --format docker --build-arg DEBIAN_IMAGE="$BASE_IMAGE" "${secrets[@]}" "$@" \
      -f Dockerfile -t "$tag" . 2>&1 |
    while IFS= read -r line; do printf '[%5ds] %s\n' $((SECONDS - t0)) "$line"; done |
    tee "$log" | { grep --line-buffered -E "$SHOW" || true; }; then
    echo "build_images: building $tag failed; the end of $log:" >&2
    tail -n 60 "$log" >&2
    exit 1
  fi
}

build_image() {  # build_image VARIANT
  # The build stage is tagged too (localhost/moh-serve-build:VARIANT): the
  # final image does not descend from it, and an untagged leaf would count as
  # dangling, be pruned below and lose its layer cache. The second build
  # takes the build stage from the cache.
  bud "localhost/moh-serve-build:$1" "$LOG_DIR/build-$1-stage.log" \
    --build-arg TORCH_VARIANT="$1" --target build
  bud "localhost/moh-serve:$1" "$LOG_DIR/build-$1.log" --build-arg TORCH_VARIANT="$1"
  # Layers of earlier builds that no tagged image uses any more (dangling
  # images built on our base image; removing one can leave its parent
  # dangling, hence the loop).
  local ids removed=0
  while ids="$(buildah images -q --filter dangling=true --filter label=moh-serve.base)" &&
    [ -n "$ids" ]; do
    # shellcheck disable=SC2086
    buildah rmi $ids >/dev/null || break
    removed=$((removed + $(wc -w <<<"$ids")))
  done
  if [ "$removed" -gt 0 ]; then say "removed $removed image(s) of earlier builds"; fi
}

for variant in cpu cuda; do
  if [ "$variant" = cpu ] && [ "$cpu" = 0 ]; then continue; fi
  if [ "$variant" = cuda ] && [ "$cuda" = 0 ]; then continue; fi
  step_start "image localhost/moh-serve:$variant"
  if [ "$variant" = cuda ]; then
    say "LibTorch: the PyPI torch $MOH_TORCH_WHEEL_VERSION wheel (scripts/torch_wheel.env)"
  fi
  build_image "$variant"
  step_end
done

say "images:"
buildah images --format '{{.Name}}:{{.Tag}}  {{.Size}}  {{.CreatedAtRaw}}' |
  grep -E "^(localhost/moh-serve|localhost/moh-serve-build|${BASE_IMAGE%:*}):" | sed 's/^/  /' || true
say "durations:"
printf '  %s\n' "${timings[@]}"
