# Sourced by the slow tiers' venv scripts. A multi-GB server venv (SGLang, vLLM) is built once per
# recipe under ~/.cache/lorafleet/venvs/<name>-<recipe hash> and linked as .venvs/<name>, so a clean
# clone on the same machine (CI) links it in a second instead of unpacking 3.5 GB again (4-8 min on
# 2 cores). The hash covers the script that builds it: changing the recipe builds a new venv.
# Usage: cached_venv NAME SCRIPT -> sets VENV (where to build) and returns 0 if it is already built.
cached_venv() {
  local name=$1 script=$2 key cache
  key=$(sha256sum "$script" | cut -c1-16)
  cache=${LORAFLEET_VENV_CACHE:-$HOME/.cache/lorafleet/venvs}/$name-$key
  VENV=$cache
  mkdir -p .venvs "$(dirname "$cache")"
  if [[ -f $cache/.installed ]]; then
    ln -sfn "$cache" ".venvs/$name"
    echo ".venvs/$name -> $cache (cached)"
    return 0
  fi
  rm -rf "$cache"
  [[ -L .venvs/$name || ! -e .venvs/$name ]] || rm -rf ".venvs/$name"
  return 1
}
