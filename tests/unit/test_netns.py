"""EmulatedNetwork: rate parsing and validation (pure), then real namespaces, tbf, TCP, cleanup.

The tests that create namespaces need root and iproute2; elsewhere they skip, saying why.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from syncline.errors import ConfigError
from syncline.launch import netns
from syncline.launch.netns import (
    HOST_IFNAME,
    EmulatedNetwork,
    NetworkEmulationError,
    check_prerequisites,
    cleanup_stale,
    parse_rate,
)

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 30


@pytest.mark.parametrize(
    ("text", "bits"),
    [
        ("100mbit", 100_000_000),
        ("1gbit", 1_000_000_000),
        ("500kbit", 500_000),
        ("1000bit", 1_000),
        ("1tbit", 10**12),
        ("1.5Gbit", 1_500_000_000),
        (" 64kibit ", 65_536),
        ("2mibit", 2 * 2**20),
        ("10mbps", 80_000_000),  # tc's bps is BYTES per second
        ("12.5MBPS", 100_000_000),
        ("1kibps", 8_192),
        (".5mbit", 500_000),
    ],
)
def test_parse_rate_table(text: str, bits: int) -> None:
    assert parse_rate(text) == bits


@pytest.mark.parametrize(
    "text",
    ["", "100", "mbit", "fast", "-1mbit", "0mbit", "999bit", "2tbit", "1e3mbit", "10%",
     "1.2.3mbit", "nanmbit", "infgbit", "100 mbitz", "100m bit"],
)  # fmt: skip
def test_parse_rate_rejects_nonsense_naming_value_and_examples(text: str) -> None:
    with pytest.raises(ConfigError, match="100mbit") as info:
        parse_rate(text)
    assert repr(text) in str(info.value)


def test_parse_rate_rejects_non_strings() -> None:
    with pytest.raises(ConfigError):
        parse_rate(100_000_000)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_hosts": 0},
        {"num_hosts": 255},
        {"num_hosts": True},
        {"num_hosts": 2.0},
        {"rate": "fast"},
        {"subnet_id": 256},
        {"subnet_id": -1},
        {"prefix": "SL"},
        {"prefix": "s1"},
        {"prefix": ""},
    ],
)
def test_constructor_rejects_bad_arguments(kwargs: dict[str, object]) -> None:
    args: dict[str, object] = {"num_hosts": 2, "rate": "10mbit", **kwargs}
    with pytest.raises(ConfigError):
        EmulatedNetwork(**args)  # type: ignore[arg-type]


def test_constructor_creates_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("the constructor ran a command")

    monkeypatch.setattr(subprocess, "run", forbidden)
    net = EmulatedNetwork(3, "1gbit", subnet_id=7)
    assert net.rate_bps == 10**9
    with pytest.raises(NetworkEmulationError, match="not started"):
        _ = net.hosts
    net.stop()  # stopping a network never started is a no-op


def test_prerequisites_explain_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(shutil, "which", lambda tool: None)
    with pytest.raises(NetworkEmulationError, match="iproute2") as info:
        check_prerequisites()
    assert "root" in str(info.value)
    with pytest.raises(NetworkEmulationError):
        EmulatedNetwork(2, "10mbit").start()  # checked before anything is created


def test_tbf_command_carries_exact_rate() -> None:
    argv = netns._tbf_argv("ns", "dev0", 123_456_789)
    assert argv[:9] == ["tc", "-n", "ns", "qdisc", "replace", "dev", "dev0", "root", "tbf"]
    assert argv[argv.index("rate") + 1] == "123456789bit"
    assert int(argv[argv.index("burst") + 1]) >= 1514


# --- real namespaces -------------------------------------------------------------------------


@pytest.fixture
def needs_root() -> None:
    try:
        check_prerequisites()
    except NetworkEmulationError as exc:
        pytest.skip(str(exc))


@pytest.fixture
def net(needs_root: None) -> Iterator[EmulatedNetwork]:
    with EmulatedNetwork(2, "20mbit", subnet_id=42) as network:
        yield network


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


def _root_links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True)
    return {line.split(":")[1].strip().split("@")[0] for line in out.stdout.splitlines()}


def _tbf_rate_bps(namespace: str, dev: str) -> int:
    argv = ["tc", "-j", "-n", namespace, "qdisc", "show", "dev", dev]
    out = subprocess.run(argv, capture_output=True, text=True, check=True)
    (qdisc,) = [q for q in json.loads(out.stdout) if q.get("root")]
    assert qdisc["kind"] == "tbf"
    return int(qdisc["options"]["rate"]) * 8  # tc's JSON gives bytes per second


def _our_names(network: EmulatedNetwork) -> set[str]:
    return {name for name, _ in network.hosts} | {network.switch_namespace}


def test_namespaces_addresses_and_tbf_on_both_ends(net: EmulatedNetwork) -> None:
    assert [ip for _, ip in net.hosts] == ["10.123.42.1", "10.123.42.2"]
    assert _our_names(net) <= _namespaces()
    for i, (namespace, ip) in enumerate(net.hosts):
        assert namespace.startswith(f"sl{os.getpid()}n")
        assert _tbf_rate_bps(namespace, HOST_IFNAME) == 20_000_000
        assert _tbf_rate_bps(net.switch_namespace, f"p{i}") == 20_000_000
        out = subprocess.run(
            net.exec_argv(i, ["ip", "-o", "addr", "show", "dev", HOST_IFNAME]),
            capture_output=True,
            text=True,
            check=True,
        )
        assert f"inet {ip}/24" in out.stdout
    assert "p0" not in _root_links()  # the bridge and its ports live in the switch namespace


ECHO_SERVER = """
import socket, sys
with socket.create_server((sys.argv[1], 5001)) as srv:
    srv.settimeout(20)
    print("ready", flush=True)
    conn, _ = srv.accept()
    with conn:
        conn.settimeout(20)
        chunks = []
        while chunk := conn.recv(65536):  # until the client shuts down its sending side
            chunks.append(chunk)
        conn.sendall(b"".join(chunks)[::-1])
"""

ECHO_CLIENT = """
import socket, sys
with socket.create_connection((sys.argv[1], 5001), timeout=20) as conn:
    payload = bytes(range(256)) * 400  # about 70 full-size frames through both tbfs
    conn.sendall(payload)
    conn.shutdown(socket.SHUT_WR)
    chunks = []
    while chunk := conn.recv(65536):
        chunks.append(chunk)
    data = b"".join(chunks)
    print("ok" if data == payload[::-1] else "mismatch", flush=True)
"""


def test_tcp_between_hosts(net: EmulatedNetwork) -> None:
    server_ip = net.hosts[0][1]
    server = subprocess.Popen(
        net.exec_argv(0, [sys.executable, "-c", ECHO_SERVER, server_ip]),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert _readline(server, TIMEOUT_S) == "ready"
        client = subprocess.run(
            net.exec_argv(1, [sys.executable, "-c", ECHO_CLIENT, server_ip]),
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
        assert client.stdout.strip() == "ok", client.stderr
        assert server.wait(TIMEOUT_S) == 0
    finally:
        server.kill()
        server.wait()


def test_nothing_left_after_exit(needs_root: None) -> None:
    links_before = _root_links()
    with EmulatedNetwork(3, "1gbit") as network:
        names = _our_names(network)
        assert names <= _namespaces()
        assert _root_links() == links_before
    assert not names & _namespaces()
    assert _root_links() == links_before
    network.stop()  # idempotent


def test_cleanup_after_exception_in_with_block(needs_root: None) -> None:
    with pytest.raises(KeyError), EmulatedNetwork(2, "10mbit") as network:
        names = _our_names(network)
        raise KeyError("boom")
    assert names and not names & _namespaces()


def test_failed_start_undoes_partial_state(
    needs_root: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tc failure half-way through start() leaves no namespace behind and says why."""
    real = netns._tbf_argv
    monkeypatch.setattr(
        netns, "_tbf_argv", lambda ns, dev, rate: [*real(ns, dev, rate)[:-2], "latency", "soon"]
    )
    network = EmulatedNetwork(2, "10mbit")
    with pytest.raises(NetworkEmulationError, match="tc -n"):
        network.start()
    assert not any(name.startswith(f"sl{os.getpid()}n") for name in _namespaces())
    network.stop()


SIGNALLED_CHILD = """
import json, signal, time
from syncline.launch.netns import EmulatedNetwork
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in an interactive process
net = EmulatedNetwork(2, "10mbit").start()
print(json.dumps([name for name, _ in net.hosts] + [net.switch_namespace]), flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_cleanup_on_signal(needs_root: None, signum: signal.Signals) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", SIGNALLED_CHILD],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        names = set(json.loads(_readline(child, TIMEOUT_S)))
        assert names <= _namespaces()
        child.send_signal(signum)
        assert child.wait(TIMEOUT_S) == -signum  # cleaned up, then died by the signal
    finally:
        child.kill()
        child.wait()
    assert not names & _namespaces()


def test_cleanup_stale_removes_only_dead_owners(needs_root: None) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    prefix = "t" + "".join(chr(ord("a") + int(d)) for d in str(os.getpid()))  # unique to this run
    stale, alive = f"{prefix}{dead.pid}n0h0", f"{prefix}1n0sw"  # pid 1 is always alive
    for name in (stale, alive):
        subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        with EmulatedNetwork(1, "10mbit", prefix=prefix) as network:
            assert cleanup_stale(prefix) == [stale]
            assert {alive, *_our_names(network)} <= _namespaces()
        assert stale not in _namespaces()
    finally:
        for name in (stale, alive):
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)


def _readline(proc: subprocess.Popen[str], timeout_s: float) -> str:
    """One stdout line of ``proc``, or fail after ``timeout_s`` instead of hanging the test."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    assert ready, f"no output within {timeout_s} s"
    return proc.stdout.readline().strip()
