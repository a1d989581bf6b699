#!/usr/bin/env bash
# Export a fetched ComfyUI git directory (no work tree) into a plain folder, trimmed for carrying
# to the GPU machine: no tests, tokenizer data or api_nodes.  Blobs absent from the snapshot are
# skipped.   usage: bench/export_comfyui.sh GIT_DIR DEST
set -euo pipefail
src=$1; dest=$2
mkdir -p "$dest"
git --git-dir="$src" ls-tree -r HEAD | while read -r mode type sha path; do
  [ "$type" = blob ] || continue
  case "$path" in
    tests/*|tests-unit/*|comfy_api_nodes/*|*/t5_tokenizer/*|*/sd1_tokenizer/*|*tokenizer*.json|*.safetensors|*.png|*.jpg|*.webp|*.gif) continue;;
  esac
  mkdir -p "$dest/$(dirname "$path")"
  git --git-dir="$src" cat-file blob "$sha" > "$dest/$path" 2>/dev/null || rm -f "$dest/$path"
done
