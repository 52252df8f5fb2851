#!/usr/bin/env bash
# Runs the example programs of MSCCL++'s DSL (python/mscclpp/language/tests) and writes the
# plans they print into OUT_DIR, for tests/dsl_plans.rs:
#   MSCCLPP_DSL_PLANS=OUT_DIR cargo test -p mscclpp-executor --test dsl_plans -- --nocapture
# MSCCLPP is a checkout of github.com/microsoft/mscclpp or a bare git directory (its HEAD is
# used). Only the pure-Python `mscclpp.language` package is needed: it is imported from a
# stub `mscclpp` package, so the native extension is not built. Nothing is copied into this
# repository. Usage: mscclpp_dsl_plans.sh MSCCLPP OUT_DIR
set -euo pipefail
src=${1:?usage: $0 MSCCLPP OUT_DIR}
out=${2:?usage: $0 MSCCLPP OUT_DIR}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if [ -d "$src/python/mscclpp/language" ]; then
    mkdir -p "$work/python/mscclpp" && cp -r "$src/python/mscclpp/language" "$work/python/mscclpp/"
else
    git --git-dir="$src" archive HEAD python/mscclpp/language | tar -x -C "$work"
fi
stub="$work/stub"
mkdir -p "$stub/mscclpp" "$out"
cp -r "$work/python/mscclpp/language" "$stub/mscclpp/"
: > "$stub/mscclpp/__init__.py"
ok=0 failed=0
run() { # NAME SCRIPT ARGS...
    local name=$1 script=$2
    shift 2
    if PYTHONPATH="$stub" timeout 60 python3 "$script" "$@" > "$out/$name.json" 2> "$work/err"; then
        ok=$((ok + 1))
    else
        rm -f "$out/$name.json"
        return 1
    fi
}
while IFS= read -r f; do
    b=$(basename "$f" .py)
    d=$(basename "$(dirname "$f")")
    if grep -q -- '--gpus_per_node' "$f"; then
        for g in 2 4 8; do
            if grep -q -- '--tbg_size' "$f"; then
                run "${d}__${b}__g$g" "$f" --name "$b" --num_gpus $((2 * g)) --gpus_per_node $g --tbg_size 2 \
                    || { failed=$((failed + 1)); echo "failed: $d/$b g$g: $(tail -1 "$work/err")"; }
            else
                run "${d}__${b}__g$g" "$f" --name "$b" --gpus_per_node $g \
                    || { failed=$((failed + 1)); echo "failed: $d/$b g$g: $(tail -1 "$work/err")"; }
            fi
        done
    elif grep -q -- '--num_gpus' "$f"; then
        for n in 2 4 8; do
            run "${d}__${b}__$n" "$f" --name "$b" --num_gpus $n \
                || { failed=$((failed + 1)); echo "failed: $d/$b $n: $(tail -1 "$work/err")"; }
        done
    elif grep -q -- '--name' "$f"; then
        run "${d}__${b}" "$f" --name "$b" || { failed=$((failed + 1)); echo "failed: $d/$b: $(tail -1 "$work/err")"; }
    else
        run "${d}__${b}" "$f" || { failed=$((failed + 1)); echo "failed: $d/$b: $(tail -1 "$work/err")"; }
    fi
done < <(find "$work/python/mscclpp/language/tests" -name '*.py' | sort)
echo "wrote $ok plans to $out ($failed programs failed in the DSL itself)"
