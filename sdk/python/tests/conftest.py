"""Fixtures: a real control-plane binary (target/debug/control-plane, built by
`cargo build --workspace --bins`) on a free loopback port with a fresh data dir.

Without the binary the tests that need it are skipped with a message, except under CI=true,
where they fail."""

import os
import pathlib
import re
import subprocess
import threading

import pytest

REPO = pathlib.Path(__file__).resolve().parents[3]


def _binary(name: str) -> pathlib.Path:
    directory = pathlib.Path(os.environ.get("PREFIX_ROUTER_BIN_DIR", REPO / "target" / "debug"))
    return directory / name


def require(what: str, ok: bool):
    """Skips (with `what`) unless `ok`; under CI=true fails instead."""
    if ok:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"{what} (CI=true: .ci/run builds and installs everything)")
    pytest.skip(what)


class ControlPlane:
    def __init__(self, tmp_path, extra_args=()):
        binary = _binary("control-plane")
        require(f"{binary} is not built: run `cargo build --workspace --bins`", binary.exists())
        self.process = subprocess.Popen(
            [str(binary), "--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "cp"), *extra_args],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        self.stderr = []
        for line in self.process.stderr:
            self.stderr.append(line)
            found = re.search(r"control-plane listening on (\S+)", line)
            if found:
                self.address = found.group(1)
                break
        else:
            self.process.wait()
            raise RuntimeError(f"control-plane exited before it listened: {''.join(self.stderr)}")
        # Keep draining stderr so the server never blocks on a full pipe.
        threading.Thread(target=lambda: [self.stderr.append(l) for l in self.process.stderr],
                         daemon=True).start()
        self.url = f"http://{self.address}"

    def stop(self):
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@pytest.fixture
def control_plane(tmp_path):
    cp = ControlPlane(tmp_path)
    yield cp
    cp.stop()
