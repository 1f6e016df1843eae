#!/usr/bin/env bash
# fetch-peers.sh -- put the peer NSA implementations that bench/peers.py times into the
# git-ignored folder peers/ (or $NSA_PEERS), pruned to the Python packages, so the folder can
# travel to a GPU machine with the device tool's `carry` (64 MiB in all, with the work tree).
# Peers are never committed: /peers/ is in .gitignore.
#
#   peers/fla     fla-org/flash-linear-attention, only fla/ + LICENSE   (~5.6 MB)
#                 (fla.ops.nsa.parallel_nsa; tests/, benchmarks/, evals/, examples/ dropped)
#   peers/mdy666  mdy666/Scalable-Flash-Native-Sparse-Attention, only flash_nsa/ + LICENSE +
#                 README.md (~0.5 MB; imgs/, notebooks, nano-vllm/, tests dropped)
#   peers/<name>/PEER_COMMIT   the commit the files were exported from
#
# Where the repositories come from, first that works:
#   1. a bare mirror $MIRROR/<owner>+<name>/repo (default MIRROR=/work/.mirror): what the
#      agent environment's `fetch` tool writes (call fetch("github:fla-org/flash-linear-attention")
#      and fetch("github:mdy666/Scalable-Flash-Native-Sparse-Attention") first);
#   2. with PEERS_CLONE=1, a shallow `git clone` from GitHub (a machine with internet access).
# Exported with `git --git-dir=... archive HEAD <paths> | tar -x`, so no .git travels.
#
#   bash scripts/fetch-peers.sh            # both peers
#   bash scripts/fetch-peers.sh fla        # just one
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PEERS="${NSA_PEERS:-$PWD/peers}"
MIRROR="${MIRROR:-/work/.mirror}"
mkdir -p "$PEERS"

# name | owner/repo | paths kept (archive pathspecs)
PEER_LIST=(
    "fla|fla-org/flash-linear-attention|fla LICENSE"
    "mdy666|mdy666/Scalable-Flash-Native-Sparse-Attention|flash_nsa LICENSE README.md"
)

export_peer() {
    local name="$1" repo="$2" keep="$3" gitdir tmp="" dest="$PEERS/$1"
    gitdir="$MIRROR/${repo/\//+}/repo"
    [ -d "$gitdir/.git" ] && gitdir="$gitdir/.git"
    if ! git --git-dir="$gitdir" rev-parse --verify -q HEAD > /dev/null 2>&1; then
        if [ "${PEERS_CLONE:-0}" = 1 ]; then
            tmp="$(mktemp -d)"
            git clone -q --depth 1 "https://github.com/$repo.git" "$tmp/repo"
            gitdir="$tmp/repo/.git"
        else
            echo "fetch-peers: $name: no mirror at $gitdir (use the environment's fetch tool for" \
                 "github:$repo, set MIRROR=, or PEERS_CLONE=1 to git clone); skipped" >&2
            return 1
        fi
    fi
    rm -rf "$dest"
    mkdir -p "$dest"
    # shellcheck disable=SC2086  # keep is a list of pathspecs
    git --git-dir="$gitdir" archive HEAD $keep | tar -x -C "$dest"
    # drop what the harness never imports (tests inside the package, compiled caches)
    find "$dest" \( -name '__pycache__' -o -name '*.pyc' \) -prune -exec rm -rf {} +
    git --git-dir="$gitdir" log -1 --format="%H %cd $repo" > "$dest/PEER_COMMIT"
    [ -n "$tmp" ] && rm -rf "$tmp"
    echo "fetch-peers: $name <- $repo @ $(cut -c1-12 "$dest/PEER_COMMIT"), $(du -sh "$dest" | cut -f1)"
}

rc=0
for entry in "${PEER_LIST[@]}"; do
    IFS='|' read -r name repo keep <<< "$entry"
    if [ $# -gt 0 ] && [[ " $* " != *" $name "* ]]; then continue; fi
    export_peer "$name" "$repo" "$keep" || rc=1
done
total_kb=$(du -sk "$PEERS" | cut -f1)
echo "fetch-peers: $PEERS holds $((total_kb / 1024)) MiB (the device carry limit is 64 MiB with the work tree)"
exit $rc
