"""Emulate a slow cluster network on one machine with namespaces, veths, a bridge and tc tbf.

Topology of ``EmulatedNetwork(3, "100mbit")`` started by pid 4242 (first network of the process)::

    netns sl4242n0h0            netns sl4242n0sw               netns sl4242n0h1
    sl0 10.123.0.1/24 ==veth== p0 --+                  +-- p1 ==veth== sl0 10.123.0.2/24
      tbf egress                 tbf egress   br0   tbf egress           tbf egress
                                              |
                                              +-- p2 ==veth== sl0 10.123.0.3/24 (sl4242n0h2)

Every host is its own network namespace, so ranks started there with ``exec_argv`` talk through a
real TCP/IP stack. The bridge lives in a dedicated "switch" namespace, so nothing is added to the
root namespace's links, and the subnet is reachable only inside these namespaces. A token bucket
(tbf) on the egress of both ends of every veth caps each host's NIC at ``rate`` in both
directions. netem is not needed (and not assumed to exist), so there is no added delay or loss.

Deleting a network namespace destroys the links in it; ``stop`` still deletes the veths and the
bridge first, so they vanish even while a leftover process keeps a host namespace alive.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import re
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable, Sequence
from types import FrameType, TracebackType
from typing import Any

from syncline.errors import ConfigError
from syncline.fields import check_int

__all__ = [
    "HOST_IFNAME",
    "EmulatedNetwork",
    "NetworkEmulationError",
    "check_prerequisites",
    "cleanup_stale",
    "parse_rate",
]

logger = logging.getLogger(__name__)

HOST_IFNAME = "sl0"
"""Name of the emulated NIC inside every host namespace; set ``GLOO_SOCKET_IFNAME`` to it."""

DEFAULT_PREFIX = "sl"
_BRIDGE = "br0"
_QUEUE_LATENCY = "50ms"  # tbf queue length, as the longest time a packet may wait in it
_CMD_TIMEOUT_S = 30.0
_MIN_RATE_BPS = 1_000
_MAX_RATE_BPS = 10**12
_MAX_HOSTS = 254  # host i gets the address .i+1 of a /24

# tc-style units (tc(8), "RATES"): SI prefixes are powers of 1000, IEC ones powers of 1024,
# and "bps" means BYTES per second, exactly as tc reads them.
_RATE_UNITS: dict[str, int] = {
    "bit": 1,
    "kbit": 10**3,
    "mbit": 10**6,
    "gbit": 10**9,
    "tbit": 10**12,
    "kibit": 2**10,
    "mibit": 2**20,
    "gibit": 2**30,
    "tibit": 2**40,
    "bps": 8,
    "kbps": 8 * 10**3,
    "mbps": 8 * 10**6,
    "gbps": 8 * 10**9,
    "tbps": 8 * 10**12,
    "kibps": 8 * 2**10,
    "mibps": 8 * 2**20,
    "gibps": 8 * 2**30,
    "tibps": 8 * 2**40,
}
_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]+)\s*$", re.IGNORECASE)
_PREFIX_RE = re.compile(r"^[a-z]{1,8}$")
# Failures that only mean "already gone": quiet during teardown.
_GONE_MARKERS = ("Cannot find device", "No such file or directory", "Cannot open network namespace")


class NetworkEmulationError(RuntimeError):
    """The host cannot emulate a network (not root, missing tools) or an ip/tc command failed."""


def parse_rate(s: str) -> int:
    """Parse a tc-style rate into bits per second.

    The units are tc's own, so a string means the same here and on a ``tc`` command line:
    ``bit kbit mbit gbit tbit`` (powers of 1000), ``kibit mibit gibit tibit`` (powers of 1024),
    and ``bps kbps mbps gbps tbps`` / ``kibps ...`` which are BYTES per second (so "10mbps" is
    80 Mbit/s). Units are case-insensitive; a bare number is rejected, as bits or bytes would
    be a guess.

    Args:
        s: a number (decimals allowed) followed by a unit, e.g. "100mbit".

    Returns:
        The rate in bits per second, rounded to an integer.

    Raises:
        ConfigError: the string does not parse, or the rate is outside 1kbit..1tbit.

    Example:
        >>> parse_rate("1.5gbit"), parse_rate("10mbps"), parse_rate("1kibit")
        (1500000000, 80000000, 1024)
    """
    valid = "e.g. '100mbit', '1gbit', '500kbit', '12.5mbps' (bps = bytes/s)"
    match = _RATE_RE.match(s) if isinstance(s, str) else None
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _RATE_UNITS:
        raise ConfigError(f"invalid rate {s!r}: expected a number and a tc unit, {valid}")
    bits = round(float(match.group(1)) * _RATE_UNITS[unit])
    if not _MIN_RATE_BPS <= bits <= _MAX_RATE_BPS:
        raise ConfigError(f"rate {s!r} = {bits} bit/s is outside 1kbit..1tbit, {valid}")
    return bits


def check_prerequisites() -> None:
    """Fail early, before anything is created, when this host cannot emulate a network.

    Raises:
        NetworkEmulationError: not root, or the ``ip``/``tc`` commands are missing; the
            message says what to change.
    """
    problems = []
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        problems.append(
            f"command(s) {', '.join(missing)} not found: install iproute2 "
            "(Debian/Ubuntu: apt-get install iproute2)"
        )
    if os.geteuid() != 0:
        problems.append(
            f"running as uid {os.geteuid()}: creating network namespaces needs root "
            "(CAP_NET_ADMIN), e.g. sudo or a container started with --cap-add NET_ADMIN"
        )
    if problems:
        raise NetworkEmulationError("cannot emulate a network: " + "; ".join(problems))


def _run(argv: Sequence[str]) -> str:
    """Run one ip/tc command, returning stdout; a failure raises with the command and stderr."""
    try:
        done = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=_CMD_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetworkEmulationError(f"`{' '.join(argv)}` failed: {exc}") from exc
    if done.returncode != 0:
        raise NetworkEmulationError(
            f"`{' '.join(argv)}` exited {done.returncode}: {done.stderr.strip()}"
        )
    return done.stdout


def _run_quietly(argv: Sequence[str]) -> None:
    """Run a teardown command: never raise; log unless the object was already gone."""
    try:
        _run(argv)
    except NetworkEmulationError as exc:
        gone = any(marker in str(exc) for marker in _GONE_MARKERS)
        logger.log(logging.DEBUG if gone else logging.WARNING, "cleanup: %s", exc)


def _burst_bytes(rate_bps: int) -> int:
    """tbf bucket size: tc-tbf(8) wants at least rate/HZ; 10 ms of traffic covers HZ >= 100.

    The 16 KiB floor keeps it well above one full-size frame (1514 bytes), which tbf needs.
    """
    return max(rate_bps // 8 // 100, 16 * 1024)


def _tbf_argv(netns: str, dev: str, rate_bps: int) -> list[str]:
    """The tc command that caps the egress of ``dev`` in ``netns`` at ``rate_bps``."""
    return [
        *("tc", "-n", netns, "qdisc", "replace", "dev", dev, "root", "tbf"),
        *("rate", f"{rate_bps}bit", "burst", str(_burst_bytes(rate_bps))),
        *("latency", _QUEUE_LATENCY),
    ]


def _list_namespaces() -> list[str]:
    """Names from ``ip netns list``, whose lines look like ``name (id: 3)`` or ``name``."""
    return [line.split()[0] for line in _run(["ip", "netns", "list"]).splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (a reused pid counts as alive: the safe side)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Delete namespaces left by crashed earlier runs whose owning process is gone.

    Our names are ``<prefix><pid>n<seq>h<i>`` or ``<prefix><pid>n<seq>sw``; a namespace is
    stale when that pid no longer exists. Namespaces of live processes are left alone.

    Args:
        prefix: the ``prefix`` the crashed networks were created with.

    Returns:
        The names of the namespaces deleted.

    Raises:
        ConfigError: the prefix is not 1-8 lowercase letters.
        NetworkEmulationError: not root, ``ip`` missing, or ``ip netns list`` failed.
    """
    _check_prefix(prefix)
    check_prerequisites()
    pattern = re.compile(rf"^{prefix}(\d+)n\d+(?:h\d+|sw)$")
    stale = []
    for name in _list_namespaces():
        match = pattern.match(name)
        if match and int(match.group(1)) != os.getpid() and not _pid_alive(int(match.group(1))):
            _delete_namespace(name)
            stale.append(name)
    return stale


def _check_prefix(prefix: str) -> None:
    """Letters only, so the pid that follows the prefix in a name is unambiguous."""
    if not isinstance(prefix, str) or not _PREFIX_RE.match(prefix):
        raise ConfigError(f"invalid prefix {prefix!r}: expected 1-8 lowercase letters, e.g. 'sl'")


def _delete_namespace(name: str) -> None:
    """Delete one namespace; warn when processes inside keep its network stack alive."""
    try:
        pids = _run(["ip", "netns", "pids", name]).split()
    except NetworkEmulationError:
        pids = []
    if pids:
        logger.warning("namespace %s still holds pids %s; it lives until they exit", name, pids)
    _run_quietly(["ip", "netns", "delete", name])


class EmulatedNetwork:
    """N emulated hosts on one switch, each NIC capped at ``rate`` in both directions.

    The constructor only validates; ``start()`` (or ``with``) creates everything and ``stop()``
    (or leaving the ``with``) deletes it, also on exceptions, at interpreter exit and on
    SIGINT/SIGTERM, after which the signal takes its previous course.

    Args:
        num_hosts: number of hosts, 1..254.
        rate: tc-style per-NIC rate, see ``parse_rate``.
        subnet_id: third octet k of the private subnet 10.123.k.0/24; host i is 10.123.k.i+1.
        prefix: first letters of every namespace name, for ``cleanup_stale``.

    Raises:
        ConfigError: a bad argument.

    Example:
        >>> with EmulatedNetwork(2, "100mbit") as net:  # doctest: +SKIP
        ...     ns, ip = net.hosts[0]
        ...     subprocess.run(net.exec_argv(1, ["iperf3", "-c", ip]), check=True)
    """

    def __init__(
        self, num_hosts: int, rate: str, *, subnet_id: int = 0, prefix: str = DEFAULT_PREFIX
    ) -> None:
        check_int("num_hosts", num_hosts, low=1, high=_MAX_HOSTS)
        check_int("subnet_id", subnet_id, low=0, high=255)
        _check_prefix(prefix)
        self.num_hosts = num_hosts
        self.rate_bps = parse_rate(rate)
        self.subnet_id = subnet_id
        self.prefix = prefix
        self._names: list[str] = []  # host namespaces, then the switch, once started
        self._namespaces: list[str] = []  # created (or being created), for teardown
        self._links: list[tuple[str, str]] = []  # (namespace, device), for teardown
        self._started = False
        self._owner_pid = 0  # the process that started it; forked children never tear it down

    @property
    def hosts(self) -> list[tuple[str, str]]:
        """``(namespace, ip)`` of every host, in host order."""
        self._require_started()
        return [(self._names[i], self._ip(i)) for i in range(self.num_hosts)]

    @property
    def switch_namespace(self) -> str:
        """The namespace holding the bridge and the switch-side veth ends ``p<i>``."""
        self._require_started()
        return self._names[-1]

    def exec_argv(self, host_index: int, argv: Sequence[str]) -> list[str]:
        """The command line that runs ``argv`` on host ``host_index`` (needs root).

        Example: ``exec_argv(0, ["python", "x.py"])`` is
        ``["ip", "netns", "exec", "sl4242n0h0", "python", "x.py"]``.
        """
        self._require_started()
        if isinstance(host_index, bool) or host_index not in range(self.num_hosts):
            raise ConfigError(f"host_index must be in 0..{self.num_hosts - 1}, got {host_index!r}")
        return ["ip", "netns", "exec", self._names[host_index], *argv]

    def start(self) -> EmulatedNetwork:
        """Create namespaces, bridge, veths and tbf limits; on any failure undo and re-raise."""
        if self._started:
            raise NetworkEmulationError("this EmulatedNetwork was already started; make a new one")
        check_prerequisites()
        self._started, self._owner_pid = True, os.getpid()
        base = f"{self.prefix}{self._owner_pid}n{next(_sequence)}"
        self._names = [f"{base}h{i}" for i in range(self.num_hosts)] + [f"{base}sw"]
        _register(self)  # before creating anything, so a signal mid-way still cleans up
        try:
            self._create()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Delete everything created; idempotent, logs instead of raising on partial state."""
        if self._owner_pid != os.getpid():  # never started, or we are a forked child
            _unregister(self)
            return
        try:
            for netns, dev in reversed(list(self._links)):
                _run_quietly(["ip", "-n", netns, "link", "delete", dev])
            for netns in reversed(list(self._namespaces)):
                _delete_namespace(netns)
            self._links.clear()
            self._namespaces.clear()
        finally:
            _unregister(self)

    def __enter__(self) -> EmulatedNetwork:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _ip(self, host_index: int) -> str:
        return f"10.123.{self.subnet_id}.{host_index + 1}"

    def _require_started(self) -> None:
        if not self._names:
            raise NetworkEmulationError("the network is not started; call start() or use `with`")

    def _add_namespace(self, name: str) -> None:
        """Record, then create: a signal between the two must not leak the namespace."""
        self._namespaces.append(name)
        try:
            _run(["ip", "netns", "add", name])
        except NetworkEmulationError:
            self._namespaces.remove(name)  # not ours (e.g. it already existed): never delete it
            raise
        _run(["ip", "-n", name, "link", "set", "lo", "up"])

    def _create(self) -> None:
        switch = self._names[-1]
        self._add_namespace(switch)
        self._links.append((switch, _BRIDGE))
        _run(["ip", "-n", switch, "link", "add", _BRIDGE, "type", "bridge"])
        _run(["ip", "-n", switch, "link", "set", _BRIDGE, "up"])
        for i in range(self.num_hosts):
            self._create_host(i, switch)

    def _create_host(self, i: int, switch: str) -> None:
        """Host namespace i, its veth to the bridge, its address and both tbf limits."""
        host, port = self._names[i], f"p{i}"
        self._add_namespace(host)
        self._links.append((switch, port))  # deleting one end of a veth deletes the pair
        veth = ("type", "veth", "peer", "name", HOST_IFNAME, "netns", host)
        _run(["ip", "-n", switch, "link", "add", port, *veth])
        _run(["ip", "-n", switch, "link", "set", port, "master", _BRIDGE])
        _run(["ip", "-n", switch, "link", "set", port, "up"])
        _run(["ip", "-n", host, "addr", "add", f"{self._ip(i)}/24", "dev", HOST_IFNAME])
        _run(["ip", "-n", host, "link", "set", HOST_IFNAME, "up"])
        _run(_tbf_argv(host, HOST_IFNAME, self.rate_bps))  # host -> switch
        _run(_tbf_argv(switch, port, self.rate_bps))  # switch -> host


# Process-wide registry of started networks: one set of signal handlers and one atexit hook
# serve all of them, so networks can stop in any order without unhooking each other.
_sequence = itertools.count()
_active: list[EmulatedNetwork] = []
_saved_handlers: dict[int, Callable[[int, FrameType | None], Any] | int] = {}
_atexit_hooked = False


def _register(net: EmulatedNetwork) -> None:
    global _atexit_hooked
    if not _atexit_hooked:
        atexit.register(_stop_all)
        _atexit_hooked = True
    if not _active:
        _install_handlers()
    _active.append(net)


def _unregister(net: EmulatedNetwork) -> None:
    if net in _active:
        _active.remove(net)
    if not _active:
        _restore_handlers()


def _stop_all() -> None:
    for net in reversed(list(_active)):
        net.stop()


def _install_handlers() -> None:
    """Hook SIGINT/SIGTERM unless ignored or set from C (neither could be restored faithfully)."""
    if threading.current_thread() is not threading.main_thread():
        logger.debug("not the main thread: cleanup relies on stop() and atexit only")
        return
    for signum in (signal.SIGINT, signal.SIGTERM):
        previous = signal.getsignal(signum)
        if previous is None or previous == signal.SIG_IGN:
            continue
        signal.signal(signum, _on_signal)
        _saved_handlers[signum] = previous


def _restore_handlers() -> None:
    for signum, previous in list(_saved_handlers.items()):
        try:
            signal.signal(signum, previous)
        except ValueError as exc:  # not the main thread
            logger.warning("could not restore the handler of signal %d: %s", signum, exc)
        del _saved_handlers[signum]


def _on_signal(signum: int, frame: FrameType | None) -> None:
    """Clean up, then let the signal do what it did before: call that handler or die by it."""
    previous = _saved_handlers.get(signum, signal.SIG_DFL)
    _stop_all()  # also restores the previous handlers
    if callable(previous):
        previous(signum, frame)
        return
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    raise SystemExit(128 + signum)  # only reached if the signal was somehow not fatal
