"""The build machine's pip sources, made reachable from a `docker build --network host`: used by
scripts/compose-check.sh (``python3 scripts/compose_pip_sources.py SERVE_DIR PORT``).

pip's index, extra index and find-links settings (``pip config list`` and ``PIP_*`` variables) that
are local folders or ``file://`` URLs are linked into SERVE_DIR under their own absolute paths, to
be served over HTTP on 127.0.0.1:PORT (an index's parent folder is linked, so that the ``../../files``
links of its pages resolve); http(s) URLs are kept. Prints ``NAME=VALUE`` lines (for ``--build-arg``) for the
Dockerfile's pip arguments that are set, and the CA bundle pip trusts here (``cert``, served the same
way) as ``PAGEDSERVE_PIP_CERT_URL``. Constraint files are not passed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

OPTIONS = {"index-url": "PIP_INDEX_URL", "extra-index-url": "PIP_EXTRA_INDEX_URL", "find-links": "PIP_FIND_LINKS"}
"""pip's option name -> the Dockerfile's build argument (pip's own environment variable)."""


CERT = "cert"
"""pip's CA bundle option (``PIP_CERT``): a file on this machine."""


def configured() -> dict[str, list[str]]:
    """Each option's values: the environment's ``PIP_*`` variable, else pip's configuration files."""
    found: dict[str, list[str]] = {}
    listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    for line in listing.splitlines():
        match = re.fullmatch(r"[\w:.-]*?\.?([\w-]+)='(.*)'", line.strip())
        if match and match.group(1) in (*OPTIONS, CERT):
            found[match.group(1)] = found.get(match.group(1), []) + match.group(2).split()
    for option, variable in (*OPTIONS.items(), (CERT, "PIP_CERT")):
        if os.environ.get(variable):
            found[option] = os.environ[variable].split()
    return {option: list(dict.fromkeys(values)) for option, values in found.items()}


def served(value: str, index: bool, serve_dir: Path, port: int) -> str:
    """``value`` as a URL the build reaches: a local folder becomes http://127.0.0.1:PORT/<its path>."""
    if re.match(r"https?://", value):
        return value
    path = Path(value.removeprefix("file://")).resolve()
    linked = path.parent if index else path
    link = serve_dir / linked.relative_to("/")
    if not link.exists():
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(linked)
    return f"http://127.0.0.1:{port}{path}"


def main(serve_dir: Path, port: int) -> int:
    local = False
    sources = configured()
    for cert in sources.pop(CERT, [])[-1:]:
        print(f"PAGEDSERVE_PIP_CERT_URL={served(cert, False, serve_dir, port)}")
    for option, values in sources.items():
        urls = [served(v, option != "find-links", serve_dir, port) for v in values]
        local |= urls != values
        print(f"{OPTIONS[option]}={' '.join(urls)}")
    if local:
        print("PIP_TRUSTED_HOST=127.0.0.1")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), int(sys.argv[2])))
