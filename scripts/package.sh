#!/usr/bin/env bash
# Builds the installable packages (DESIGN §20, issue 31) into dist/ (or $DIST), with
# no registry access:
#   polygate-V-py3-none-any.whl, polygate-V.tar.gz   the pure Python binding (as before)
#   polygate-V-py3-none-manylinux_2_N_ARCH.whl       the same + the polygate-sidecar binary
#   polygate-sidecar-linux-ARCH-gnu-V.tgz            npm platform package @polygate/sidecar-linux-ARCH-gnu
#   polygate-V.tgz                                   npm main package (optionalDependencies: the above)
# The sidecar binary is built once (cargo build --release; a no-op when it is up to
# date) and stripped; $POLYGATE_PACKAGE_BIN uses a given binary instead (the tests
# pass the debug build they already have). Only this machine's platform is built;
# another is the same script run there. Needs: cargo (unless $POLYGATE_PACKAGE_BIN),
# the Python in $PYTHON (default .venv/bin/python) with build, wheel and setuptools,
# and node/npm with bindings/node's dev dependencies (npm ci) for tsc.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
out=${DIST:-$root/dist}
python=${PYTHON:-$root/.venv/bin/python}
step() { printf '==> %s\n' "$*" >&2; }
t0=$(date +%s.%N)

bin=${POLYGATE_PACKAGE_BIN:-}
if [ -z "$bin" ]; then
    step "cargo build --release -p polygate-sidecar (once; reused when up to date)"
    cargo build --release --quiet -p polygate-sidecar
    bin="${CARGO_TARGET_DIR:-$root/target}/release/polygate-sidecar"
fi
[ -x "$bin" ] || { echo "package.sh: no sidecar binary at $bin" >&2; exit 1; }

version=$("$python" -c 'import re,sys; print(re.search(r"__version__ = \"([^\"]+)\"", open(sys.argv[1]).read()).group(1))' \
    bindings/python/polygate/_version.py)
node_version=$(node -p 'require("./bindings/node/package.json").version')
[ "$version" = "$node_version" ] || { echo "package.sh: Python $version != Node $node_version" >&2; exit 1; }

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$out"
rm -f "$out"/polygate-*.whl "$out"/polygate-*.tar.gz "$out"/polygate-*.tgz

cp "$bin" "$stage/polygate-sidecar"
chmod 0755 "$stage/polygate-sidecar"
# The release profile strips already; a debug binary (tests) shrinks a lot.
if command -v strip >/dev/null 2>&1; then
    strip "$stage/polygate-sidecar"
fi

step "Python: pure wheel + sdist, then the platform wheel with the sidecar"
mkdir "$stage/python"
(cd bindings/python && tar --exclude=build --exclude=dist --exclude='*.egg-info' --exclude=__pycache__ \
    --exclude=tests -cf - .) | tar -xf - -C "$stage/python"
"$python" -m build --no-isolation --outdir "$out" "$stage/python" >"$stage/build.log" 2>&1 \
    || { cat "$stage/build.log" >&2; exit 1; }
"$python" scripts/platform_wheel.py "$out/polygate-$version-py3-none-any.whl" "$stage/polygate-sidecar" "$out" >/dev/null

step "npm: the platform package and the main package"
platform=$(node -p 'process.platform')
arch=$(node -p 'process.arch')
pkg="@polygate/sidecar-$platform-$arch-gnu"
mkdir "$stage/npm-platform"
cp "$stage/polygate-sidecar" "$stage/npm-platform/polygate-sidecar"
cat >"$stage/npm-platform/index.js" <<'EOF'
// The polygate-sidecar binary of this platform package (DESIGN §20).
exports.binaryPath = require("node:path").join(__dirname, "polygate-sidecar");
EOF
printf '# %s\n\nThe `polygate-sidecar` binary for %s-%s (glibc), installed by `polygate` as an optional dependency.\n' \
    "$pkg" "$platform" "$arch" >"$stage/npm-platform/README.md"
PKG=$pkg VERSION=$version PLATFORM=$platform ARCH=$arch node -e '
const e = process.env;
const doc = {
  name: e.PKG, version: e.VERSION,
  description: `The polygate-sidecar binary for ${e.PLATFORM}-${e.ARCH} (glibc)`,
  license: "Apache-2.0", os: [e.PLATFORM], cpu: [e.ARCH], libc: ["glibc"],
  main: "index.js", files: ["index.js", "polygate-sidecar", "README.md"], preferUnplugged: true,
};
require("fs").writeFileSync(process.argv[1], JSON.stringify(doc, null, 2) + "\n");
' "$stage/npm-platform/package.json"

(cd bindings/node && npm run --silent build)
mkdir "$stage/npm-main"
cp -r bindings/node/dist bindings/node/bin bindings/node/README.md bindings/node/package.json "$stage/npm-main/"
PKG=$pkg VERSION=$version node -e '
const fs = require("fs");
const doc = JSON.parse(fs.readFileSync(process.argv[1], "utf8"));
delete doc.devDependencies;
delete doc.scripts;
doc.optionalDependencies = { [process.env.PKG]: process.env.VERSION };
fs.writeFileSync(process.argv[1], JSON.stringify(doc, null, 2) + "\n");
' "$stage/npm-main/package.json"
(cd "$stage/npm-platform" && npm pack --silent --pack-destination "$out" >/dev/null)
(cd "$stage/npm-main" && npm pack --silent --pack-destination "$out" >/dev/null)

t1=$(date +%s.%N)
ls -l "$out" >&2
printf 'package.sh: built in %.1f s\n' "$(echo "$t1 - $t0" | bc)" >&2
