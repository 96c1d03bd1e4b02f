"""A second "host" on this machine for the security tests: a network namespace joined to this
one by a veth pair, each end with an address of a private /30 that the fixture makes up and
removes afterwards. From inside it, this machine's loopback is out of reach (as from another
host), and its side of the pair (``host``) is reachable (as a LAN address would be)."""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

PYTHON = sys.executable
ROOT = Path(__file__).resolve().parents[2]


def _popen(argv: list[str], cwd: str | Path, env: dict[str, str] | None) -> subprocess.Popen:
    return subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        env=env,
    )


@dataclass(frozen=True)
class Namespace:
    name: str
    host: str
    """This machine's end of the veth pair: an address another host would reach it at."""
    peer: str
    """The namespace's end: an address of the "other host" (nothing listens there)."""

    def argv(self, script: str, *args: str) -> list[str]:
        """The command that runs ``script`` (Python source) with this environment's interpreter
        inside the namespace."""
        return ["ip", "netns", "exec", self.name, PYTHON, "-c", script, *args]

    def python(self, script: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        """Run ``script`` inside the namespace, to its end."""
        return subprocess.run(
            self.argv(script, *args), capture_output=True, text=True, timeout=timeout, cwd=ROOT
        )

    def popen(self, script: str, *args: str) -> subprocess.Popen:
        """Start ``script`` inside the namespace, its stdin, stdout and stderr piped (text)."""
        return _popen(self.argv(script, *args), cwd=ROOT, env=None)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def _free_subnet() -> tuple[str, str]:
    """Two addresses of a /30 in 10.213.0.0/16 that no interface of this machine uses
    (chosen from the pid): this machine's end and the namespace's."""
    used = _ip("-4", "-o", "addr", "show").stdout
    for k in range(16384):
        i = (os.getpid() + k) % 16384
        base = ipaddress.ip_address(f"10.213.{i // 64}.{(i % 64) * 4}")
        host, peer = str(base + 1), str(base + 2)
        if f" {host}/" not in used and f" {peer}/" not in used:
            return host, peer
    raise RuntimeError("no free /30 in 10.213.0.0/16")


def _why_not() -> str | None:
    if shutil.which("ip") is None:
        return "needs the ip command (iproute2) to make a network namespace"
    if os.geteuid() != 0:
        return "needs root to make a network namespace and a veth pair"
    return None


@pytest.fixture(scope="session")
def netns() -> Iterator[Namespace]:
    """The second host: namespace ``dgs<pid>`` and the veth pair ``dgs<pid>a``/``dgs<pid>b``."""
    why = _why_not()
    if why is not None:
        pytest.skip(why)
    tag = f"dgs{os.getpid() % 1_000_000}"
    name, here, there = tag, f"{tag}a", f"{tag}b"
    host, peer = _free_subnet()
    made = _ip("netns", "add", name, check=False)
    if made.returncode != 0:
        pytest.skip(f"cannot make a network namespace here: {made.stderr.strip()}")
    try:
        _ip("link", "add", here, "type", "veth", "peer", "name", there)
        _ip("link", "set", there, "netns", name)
        _ip("addr", "add", f"{host}/30", "dev", here)
        _ip("link", "set", here, "up")
        _ip("netns", "exec", name, "ip", "addr", "add", f"{peer}/30", "dev", there)
        _ip("netns", "exec", name, "ip", "link", "set", there, "up")
        _ip("netns", "exec", name, "ip", "link", "set", "lo", "up")
        yield Namespace(name, host, peer)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot set up the veth pair: {exc.stderr.strip()}")
    finally:
        _ip("link", "del", here, check=False)  # takes its peer in the namespace with it
        _ip("netns", "del", name, check=False)


# ---------------------------------------------------------------------------------------------
# a second user of this machine


@dataclass(frozen=True)
class OtherUser:
    """Another local user (``nobody``): loopback reaches everything of the job, but none of
    the job's files (0700/0600) nor its memory."""

    name: str
    argv: tuple[str, ...]
    """The interpreter this user can run, with what it needs to import distributed and digen."""
    env: dict[str, str]

    def command(self, script: str, *args: str) -> list[str]:
        """The command that runs ``script`` (Python source) as this user (``runuser``)."""
        runuser = shutil.which("runuser") or "/usr/sbin/runuser"
        return [runuser, "-u", self.name, "--", *self.argv, "-c", script, *args]

    def python(self, script: str, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
        """Run ``script`` as this user, from /, to its end."""
        return subprocess.run(
            self.command(script, *args),
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd="/",
            env=self.env,
        )

    def popen(self, script: str, *args: str) -> subprocess.Popen:
        """Start ``script`` as this user, from /, its stdin, stdout and stderr piped (text)."""
        return _popen(self.command(script, *args), cwd="/", env=self.env)


def _interpreters() -> list[tuple[tuple[str, ...], str]]:
    """(interpreter, PYTHONPATH) to try for the other user: this one (when the user may
    execute it), else the system's Python of the same version with this environment's
    packages and the checkout on its path (this one may live in a folder only root reads)."""
    import sysconfig

    root = str(ROOT)
    paths = os.pathsep.join([root, sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    found = [(PYTHON,), *((p,) for p in (shutil.which(version), f"/usr/bin/{version}") if p)]
    return [(argv, root if argv == (PYTHON,) else paths) for argv in dict.fromkeys(found)]


@pytest.fixture(scope="session")
def other_user() -> OtherUser:
    """``nobody`` (made when absent), and a Python it can run that imports distributed and
    digen; skipped, with the reason, where that cannot be had."""
    if shutil.which("runuser") is None:
        pytest.skip("needs runuser (util-linux) to act as a second local user")
    if os.geteuid() != 0:
        pytest.skip("needs root to act as a second local user (runuser)")
    import pwd

    try:
        pwd.getpwnam("nobody")
    except KeyError:
        made = subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", "nobody"],
            capture_output=True,
            text=True,
        )
        if made.returncode != 0:
            pytest.skip(f"no user nobody, and useradd failed: {made.stderr.strip()}")
    tried = []
    for argv, path in _interpreters():
        env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": path, "HOME": "/tmp", "PYTHONDONTWRITEBYTECODE": "1"}
        user = OtherUser("nobody", argv, env)
        res = user.python(
            "import distributed, digen.dataplane.blobs; print(__import__('os').getuid())", timeout=120
        )
        if res.returncode == 0 and res.stdout.strip() == str(pwd.getpwnam("nobody").pw_uid):
            return user
        tried.append(f"{argv[0]}: {(res.stderr.strip().splitlines() or ['?'])[-1]}")
    pytest.skip(f"no Python that nobody can run imports distributed and digen ({'; '.join(tried)})")
