#!/usr/bin/env bash
# fetch-peers.sh -- put the peer NSA implementations that bench/peers.py times into the
# git-ignored folder peers/ (or $NSA_PEERS), pruned to their Python packages.
# Peers are never committed: /peers/ is in .gitignore.
#
#   peers/fla     fla-org/flash-linear-attention, only fla/ + LICENSE + two test files (~7 MB)
#                 (fla.ops.nsa.parallel_nsa; tests/ops/test_nsa.py and tests/conftest.py, its
#                 fixture, which tests/python/test_fla_suite.py runs against nsa.parallel_nsa;
#                 the rest of tests/, benchmarks/, evals/, examples/ dropped)
#   peers/mdy666  mdy666/Scalable-Flash-Native-Sparse-Attention, only flash_nsa/ + LICENSE +
#                 README.md (~0.5 MB; imgs/, notebooks, nano-vllm/, tests dropped)
#   peers/<name>/PEER_COMMIT   the commit the files were exported from
#
# Where the repositories come from:
#   - by default, `git clone --depth 1` from GitHub (needs network access);
#   - with --mirror DIR (or PEERS_MIRROR=DIR), local clones in DIR instead, for offline
#     machines: each repository as DIR/<name>, DIR/<owner>/<name> or DIR/<owner>+<name>
#     (a clone, bare or not, or a folder holding one as repo/).
# A kept path written with a trailing '?' is optional: left out, with a note, when the exported
# revision has no such file (fla's test files at older commits).
# PEER_REF_<name>=<commit or branch> (e.g. PEER_REF_fla=bc3b101dcb71) exports that revision
# instead of the default branch's head (a full commit hash when cloning).
# Exported with `git archive <rev> <paths> | tar -x`, so no .git is copied.
#
#   bash scripts/fetch-peers.sh                    # both peers
#   bash scripts/fetch-peers.sh fla                # just one
#   bash scripts/fetch-peers.sh --mirror ~/src fla # from a local clone
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PEERS="${NSA_PEERS:-$PWD/peers}"
MIRROR="${PEERS_MIRROR:-}"

names=()
while [ $# -gt 0 ]; do
    case "$1" in
    --mirror) [ $# -ge 2 ] || { echo "fetch-peers: --mirror needs a folder" >&2; exit 2; }
              MIRROR="$2"; shift 2 ;;
    --mirror=*) MIRROR="${1#--mirror=}"; shift ;;
    -h|--help) sed -n '2,27p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "fetch-peers: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) names+=("$1"); shift ;;
    esac
done
mkdir -p "$PEERS"

# name | owner/repo | paths kept (archive pathspecs; a trailing '?' marks an optional one)
# test_nsa.py imports only fla itself; tests/conftest.py is the fixture every fla op test runs
# under (scratch memory from fla filled with NaN), so nsa is judged the way fla judges itself.
PEER_LIST=(
    "fla|fla-org/flash-linear-attention|fla LICENSE tests/conftest.py? tests/ops/test_nsa.py?"
    "mdy666|mdy666/Scalable-Flash-Native-Sparse-Attention|flash_nsa LICENSE README.md"
)

# The git directory of a clone of $1 (owner/name) under $MIRROR, or nothing.
mirror_gitdir() {
    local repo="$1" owner="${1%%/*}" base="${1#*/}" d g
    for d in "$MIRROR/$base" "$MIRROR/$owner/$base" "$MIRROR/$owner+$base" "$MIRROR/$owner+$base/repo"; do
        for g in "$d/.git" "$d"; do
            if [ -d "$g" ] && git --git-dir="$g" rev-parse --verify -q HEAD > /dev/null 2>&1; then
                echo "$g"
                return 0
            fi
        done
    done
    return 1
}

export_peer() {
    local name="$1" repo="$2" keep="$3" gitdir="" tmp="" dest="$PEERS/$1" refvar ref
    refvar="PEER_REF_$name"
    ref="${!refvar:-}"
    if [ -n "$MIRROR" ]; then
        if ! gitdir="$(mirror_gitdir "$repo")"; then
            echo "fetch-peers: $name: no clone of $repo in $MIRROR; skipped" >&2
            return 1
        fi
    else
        tmp="$(mktemp -d)"
        if [ -z "$ref" ]; then
            if ! git clone -q --depth 1 "https://github.com/$repo.git" "$tmp/repo"; then
                echo "fetch-peers: $name: git clone of https://github.com/$repo failed; skipped" >&2
                rm -rf "$tmp"
                return 1
            fi
        else
            if ! { git init -q "$tmp/repo" &&
                   git -C "$tmp/repo" fetch -q --depth 1 "https://github.com/$repo.git" "$ref" &&
                   git -C "$tmp/repo" update-ref HEAD FETCH_HEAD; }; then
                echo "fetch-peers: $name: fetching $ref of https://github.com/$repo failed; skipped" >&2
                rm -rf "$tmp"
                return 1
            fi
            ref=""
        fi
        gitdir="$tmp/repo/.git"
    fi
    local rev="${ref:-HEAD}" p paths=""
    for p in $keep; do
        if [[ "$p" == *\? ]]; then
            p="${p%\?}"
            if ! git --git-dir="$gitdir" cat-file -e "$rev:$p" 2> /dev/null; then
                echo "fetch-peers: $name: no $p at $rev; left out" >&2
                continue
            fi
        fi
        paths+=" $p"
    done
    rm -rf "$dest"
    mkdir -p "$dest"
    # shellcheck disable=SC2086  # paths is a list of pathspecs
    if ! git --git-dir="$gitdir" archive "$rev" $paths | tar -x -C "$dest"; then
        echo "fetch-peers: $name: exporting $rev ($paths) failed; skipped" >&2
        if [ -n "$tmp" ]; then rm -rf "$tmp"; fi
        rm -rf "$dest"
        return 1
    fi
    # drop what the harness never imports (compiled caches)
    find "$dest" \( -name '__pycache__' -o -name '*.pyc' \) -prune -exec rm -rf {} +
    git --git-dir="$gitdir" log -1 --format="%H %cd $repo" "$rev" > "$dest/PEER_COMMIT"
    if [ -n "$tmp" ]; then rm -rf "$tmp"; fi
    echo "fetch-peers: $name <- $repo @ $(cut -c1-12 "$dest/PEER_COMMIT"), $(du -sh "$dest" | cut -f1)"
}

rc=0
for n in "${names[@]}"; do
    [[ " fla mdy666 " == *" $n "* ]] || { echo "fetch-peers: unknown peer $n (fla, mdy666)" >&2; rc=1; }
done
for entry in "${PEER_LIST[@]}"; do
    IFS='|' read -r name repo keep <<< "$entry"
    if [ ${#names[@]} -gt 0 ] && [[ " ${names[*]} " != *" $name "* ]]; then continue; fi
    export_peer "$name" "$repo" "$keep" || rc=1
done
total_kb=$(du -sk "$PEERS" | cut -f1)
echo "fetch-peers: $PEERS holds $((total_kb / 1024)) MiB"
exit $rc
