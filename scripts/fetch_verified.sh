# shellcheck shell=bash
# Sourced by the scripts that build a pinned source distribution
# (install_xgrammar.sh, install_llama_cpp.sh); defines fetch_verified and
# does nothing else.

# fetch_verified FILE URL SHA256: downloads URL into FILE unless FILE is
# there already (a local copy, e.g. one the GPU bundle carries), then checks
# that FILE's sha256 is SHA256; returns non-zero (after sha256sum's message)
# when the download fails or the sum differs.
fetch_verified() {
  local file="$1" url="$2" sha256="$3"
  if [ ! -f "$file" ]; then
    curl -fsSL --retry 3 -o "$file" "$url" || return
  fi
  echo "$sha256  $file" | sha256sum -c --quiet -
}
