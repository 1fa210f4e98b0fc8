"""systemd/: the units' Documentation= point at documents of this repository, and
the socket unit outlives a restart of the service (no PartOf=/BindsTo= on it: those
would stop the socket with every `systemctl stop|restart polygate`, refusing workers
during the very restart socket activation exists to bridge)."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List

REPO = Path(__file__).resolve().parent.parent
PREFIX = "https://github.com/polygate/polygate/blob/main/"


def _unit(name: str) -> Dict[str, List[str]]:
    """Section.Key -> every value (systemd keys repeat)."""
    out: Dict[str, List[str]] = {}
    section = ""
    for raw in (REPO / "systemd" / name).read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        out.setdefault("%s.%s" % (section, key.strip()), []).append(value.strip())
    return out


def test_documentation_points_at_this_repositorys_docs() -> None:
    for name in ("polygate.service", "polygate.socket"):
        docs = _unit(name).get("Unit.Documentation", [])
        assert docs, name
        for url in docs:
            assert url.startswith(PREFIX), (name, url)
            path = url[len(PREFIX):]
            # docs/design.md is written on another branch; every other target exists.
            assert (REPO / path).is_file() or path == "docs/design.md", (name, url)


def test_socket_is_not_stopped_with_the_service() -> None:
    socket = _unit("polygate.socket")
    for key in ("Unit.PartOf", "Unit.BindsTo"):
        assert "polygate.service" not in " ".join(socket.get(key, [])), key
    assert socket["Socket.ListenStream"] == ["/run/polygate/sidecar.sock"]
