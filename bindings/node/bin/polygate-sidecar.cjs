#!/usr/bin/env node
// `polygate-sidecar` from npm (DESIGN §20): run the binary of this platform's package
// (@polygate/sidecar-PLATFORM-ARCH-gnu, an optional dependency of polygate), or
// $POLYGATE_SIDECAR, with this process's arguments, stdio and exit status.
"use strict";
const { spawnSync } = require("node:child_process");

function binaryPath() {
  if (process.env.POLYGATE_SIDECAR) return process.env.POLYGATE_SIDECAR;
  const pkg = `@polygate/sidecar-${process.platform}-${process.arch}-gnu`;
  try {
    return require(pkg).binaryPath;
  } catch {
    console.error(`polygate-sidecar: the platform package ${pkg} is not installed (no build for this `
      + "platform, or optional dependencies were skipped); install it, or set $POLYGATE_SIDECAR");
    process.exit(1);
  }
}

const bin = binaryPath();
const r = spawnSync(bin, process.argv.slice(2), { stdio: "inherit" });
if (r.error) {
  console.error(`polygate-sidecar: cannot run ${bin}: ${r.error.message}`);
  process.exit(1);
}
if (r.signal) process.kill(process.pid, r.signal);
process.exit(r.status ?? 1);
