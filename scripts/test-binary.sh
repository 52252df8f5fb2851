# Sourced by the GPU bundle scripts: test_binary PACKAGE TEST DEST builds the release binary of
# integration test TEST of PACKAGE (`cargo test --no-run`) and copies it to DEST; fails when
# cargo reports no such executable.
test_binary() {
  local pkg=$1 test=$2 dest=$3
  cargo test --release -p "$pkg" --test "$test" --no-run --message-format=json 2>/dev/null | python3 -c '
import json, shutil, sys
test, dest = sys.argv[1], sys.argv[2]
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == test:
        shutil.copy(m["executable"], dest)
' "$test" "$dest"
  test -x "$dest" || { echo "the $pkg test binary $test was not built" >&2; return 1; }
}
