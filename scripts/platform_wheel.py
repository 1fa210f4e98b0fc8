"""Make the platform wheel of polygate (DESIGN §20): the pure wheel's files plus the
sidecar binary under ``polygate-V.data/scripts/``, which pip installs beside the
environment's other scripts (on PATH in an activated venv), the layout ruff and uv
ship with maturin ``bindings = "bin"``.

    python scripts/platform_wheel.py PURE_WHEEL BINARY OUTDIR

The tag is ``py3-none-manylinux_2_N_ARCH``: N is the highest ``GLIBC_2.N`` symbol
version named in the binary (what it needs of the C library at run time), ARCH this
machine's; a binary without glibc versions (static) gets ``linux_ARCH``. Standard
library only; prints the wheel's path.
"""

from __future__ import annotations

import base64
import hashlib
import os
import platform
import re
import sys
import zipfile


def platform_tag(binary: bytes) -> str:
    arch = platform.machine()
    versions = [int(m) for m in re.findall(rb"GLIBC_2\.([0-9]+)", binary)]
    if not versions:
        return "linux_%s" % arch
    return "manylinux_2_%d_%s" % (max(versions), arch)


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return "%s,sha256=%s,%d" % (name, digest, len(data))


def build(pure: str, binary_path: str, outdir: str) -> str:
    with open(binary_path, "rb") as f:
        binary = f.read()
    tag = platform_tag(binary)
    base = os.path.basename(pure)
    m = re.fullmatch(r"(polygate)-([^-]+)-py3-none-any\.whl", base)
    if not m:
        raise SystemExit("not the pure polygate wheel: %s" % base)
    name, version = m.groups()
    dist_info = "%s-%s.dist-info" % (name, version)
    out = os.path.join(outdir, "%s-%s-py3-none-%s.whl" % (name, version, tag))
    records = []
    with zipfile.ZipFile(pure) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if info.filename in (dist_info + "/RECORD", dist_info + "/WHEEL"):
                continue
            data = src.read(info)
            dst.writestr(info, data)
            records.append(_record_line(info.filename, data))
        wheel = src.read(dist_info + "/WHEEL").decode()
        wheel = re.sub(r"(?m)^Root-Is-Purelib: .*$", "Root-Is-Purelib: false", wheel)
        wheel = re.sub(r"(?m)^Tag: .*\n?", "", wheel).rstrip("\n") + "\nTag: py3-none-%s\n" % tag
        dst.writestr(dist_info + "/WHEEL", wheel)
        records.append(_record_line(dist_info + "/WHEEL", wheel.encode()))
        script = "%s-%s.data/scripts/polygate-sidecar" % (name, version)
        info = zipfile.ZipInfo(script, date_time=(2020, 1, 1, 0, 0, 0))
        info.external_attr = (0o100755 & 0xFFFF) << 16
        info.compress_type = zipfile.ZIP_DEFLATED
        dst.writestr(info, binary)
        records.append(_record_line(script, binary))
        records.append(dist_info + "/RECORD,,")
        dst.writestr(dist_info + "/RECORD", "\n".join(records) + "\n")
    return out


if __name__ == "__main__":
    if len(sys.argv) != 4:
        raise SystemExit(__doc__)
    print(build(sys.argv[1], sys.argv[2], sys.argv[3]))
